"""Every bad input of the simulator gets one line naming what is wrong, never a traceback or a silent answer.

The ``--record`` tests each start one spawned rank (a few seconds).
"""

import json

import pytest

from simulate_cli import run_cli



def one_line(code, err, *says):
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for s in says:
        assert s in err, err


def saved_profile(tmp_path, gradients):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"format": "minddp compute profile v1", "forward_ms": 2.0, "after_backward_ms": 1.0,
                                "gradients": gradients}))
    return str(path)


def test_a_trace_with_a_negative_gradient_size_is_refused(tmp_path, capsys):
    path = saved_profile(tmp_path, [["fc.weight", 3.0, -101711872, "torch.float32"], ["fc.bias", 4.0, 40, "torch.float32"]])
    code, out, err = run_cli(capsys, "--trace", path, "--step-ms", "10")
    one_line(code, err, "--trace", "'fc.weight'", "-97 MiB", ">= 0")
    assert "efficiency" not in out


@pytest.mark.parametrize("step", [0, 1])
def test_a_chrome_trace_with_a_negative_gradient_size_in_any_step_is_refused(tmp_path, capsys, step):
    """The Chrome trace of ``MiniDDP(trace=True)``: a gradient event's ``bytes`` is checked in every step, not
    only in the one whose size the profile keeps."""
    from test_simulate import synthetic_trace

    trace = synthetic_trace()
    for event in trace["traceEvents"]:
        if event["name"] == "grad b" and event["args"]["step"] == step:
            event["args"]["bytes"] = -400
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    code, out, err = run_cli(capsys, "--trace", str(path), "--step-ms", "10")
    one_line(code, err, "--trace", "'b'", "-400", ">= 0")
    assert "efficiency" not in out


def test_absurd_gradient_sizes_are_refused(tmp_path, capsys):
    path = saved_profile(tmp_path, [["huge", 3.0, 10**18, "torch.float32"]])
    one_line(*run_cli(capsys, "--trace", path, "--step-ms", "10")[::2], "more than any GPU holds")


def test_a_malformed_saved_profile_is_one_line(tmp_path, capsys):
    path = saved_profile(tmp_path, [["w", 3.0]])
    one_line(*run_cli(capsys, "--trace", path)[::2], "--trace", "malformed")


def test_out_into_a_missing_folder_is_said_before_recording(tmp_path, capsys):
    code, out, err = run_cli(capsys, "--record", "mlp", "--out", str(tmp_path / "nowhere" / "t.json"), "--world", "8")
    one_line(code, err, "--out", "no folder")
    assert "recording" not in out


def builder(tmp_path, body):
    path = tmp_path / "mine.py"
    path.write_text("import torch\n\n" + body)
    return f"{path}:build"


def test_record_of_a_target_that_raises_is_one_line(tmp_path, capsys):
    spec = builder(tmp_path, "def build():\n    raise RuntimeError('no GPU here')\n")
    code, _, err = run_cli(capsys, "--record", spec, "--out", str(tmp_path / "t.json"), "--world", "8")
    one_line(code, err, "--record", "RuntimeError: no GPU here")


def test_record_of_a_module_that_raises_on_import_is_one_line(tmp_path, capsys):
    spec = builder(tmp_path, "raise RuntimeError('missing dependency')\ndef build():\n    pass\n")
    one_line(*run_cli(capsys, "--record", spec, "--out", str(tmp_path / "t.json"))[::2], "--record", "missing dependency")


UNUSED = ("class Two(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
          "        self.used, self.unused = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)\n"
          "    def forward(self, x):\n        return self.used(x)\n\n"
          "def build():\n    return Two(), torch.randn(4, 8)\n")


def test_record_of_a_model_with_unused_parameters_names_the_flag_and_the_flag_works(tmp_path, capsys):
    spec = builder(tmp_path, UNUSED)
    code, _, err = run_cli(capsys, "--record", spec, "--out", str(tmp_path / "t.json"), "--world", "8")
    one_line(code, err, "--record", "--find-unused-parameters")
    code, out, err = run_cli(capsys, "--record", spec, "--out", str(tmp_path / "t.json"), "--world", "8",
                         "--find-unused-parameters", "--step-ms", "5")
    assert code == 0 and "2 gradients" in out, err


PROFILE = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "docs" / "simulate-profile-resnet50.json")


@pytest.mark.parametrize("argv, says", [
    # the first kind: bad step times, missing traces, zero bandwidths, unknown presets, world 0
    (["--trace", PROFILE, "--step-ms", "-3"], "--step-ms"),
    (["--trace", PROFILE, "--step-ms", "abc"], "--step-ms"),
    (["--trace", "no/such/trace.json"], "--trace"),
    (["--trace", PROFILE, "--bandwidth", "0"], "--bandwidth"),
    (["--trace", PROFILE, "--network", "dgx-a100", "--intra-bandwidth", "0GB/s"], "--intra-bandwidth"),
    (["--trace", PROFILE, "--nominal-bandwidth", "0", "--efficiency", "0.5"], "--nominal-bandwidth"),
    (["--trace", PROFILE, "--network", "no-such-preset"], "--network"),
    (["--trace", PROFILE, "--world", "0"], "--world"),
    # the same inputs to the collective subcommand
    (["collective", "all_reduce", "--network", "dgx-a100", "--world", "12"], "not a multiple of 8 GPUs per node"),
    (["collective", "all_reduce", "--network", "dgx-a100", "--gpus-per-node", "1000000"], "no node holds more than"),
    (["collective", "all_reduce", "--network", "ib400", "--intra-bandwidth", "100GB/s"], "--intra-bandwidth"),
    (["collective", "all_reduce", "--bandwidth", "0"], "--bandwidth"),
    (["collective", "all_reduce", "--network", "no-such-preset"], "--network"),
    (["collective", "all_reduce", "--world", "0"], "--world"),
    (["collective", "all_reduce", "--bytes", "0"], "--bytes"),
    (["collective", "all_reduce", "--against", "no/such/table.txt"], "--against"),
])
def test_every_other_bad_input_the_issue_lists_is_one_line(capsys, argv, says):
    one_line(*run_cli(capsys, *argv)[::2], says)
