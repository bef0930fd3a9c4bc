"""The torch-suites runner's own logic, on a tiny fake test file (torch's real files are not in the project).

``scripts/torch_suites/run.py`` selects tests by name, re-targets GPU-only tests
to the CPU and reads results back; these tests check each of those pieces
without installing its process-wide patches (they would swap torch's DDP
class in this very pytest process).
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch

RUNNER = Path(__file__).resolve().parents[2] / "scripts" / "torch_suites"
sys.path.insert(0, str(RUNNER))
import run as torch_suites  # noqa: E402
import patches  # noqa: E402

FAKE_SUITE = textwrap.dedent('''
    import unittest

    class DistributedDataParallelTest(unittest.TestCase):
        def test_anything(self):
            pass

    class ProcessGroupTest(unittest.TestCase):
        def test_ddp_comm_hook(self):
            pass

        def test_allreduce(self):
            pass
''')


def load_fake(tmp_path: Path, module_name: str):
    path = tmp_path / f"{module_name}.py"
    path.write_text(FAKE_SUITE)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_selection_by_class_or_test_name_mentioning_ddp(tmp_path):
    tests = torch_suites.collect([load_fake(tmp_path, "test_c10d_gloo")])
    names = sorted(t.id().split(".", 1)[1] for t in tests)
    assert names == ["DistributedDataParallelTest.test_anything", "ProcessGroupTest.test_ddp_comm_hook"]


def test_the_zero_file_is_selected_whole_and_k_filters(tmp_path):
    module = load_fake(tmp_path, "test_zero_redundancy_optimizer")
    assert len(torch_suites.collect([module])) == 3
    assert [t._testMethodName for t in torch_suites.collect([module], "allreduce")] == ["test_allreduce"]


def test_suite_files_are_found_by_name_in_any_folder(tmp_path):
    (tmp_path / "test" / "distributed").mkdir(parents=True)
    (tmp_path / "test" / "distributed" / "test_c10d_gloo.py").write_text("")
    assert torch_suites.suite_modules(tmp_path) == ["test_c10d_gloo"]
    with pytest.raises(SystemExit, match="none of"):
        torch_suites.suite_modules(tmp_path / "test" / "distributed" / "missing")


def test_first_error_line_is_the_first_ranks_exception():
    text = (
        "Traceback (most recent call last):\nRuntimeError: Process 0 exited with error code 10 and exception:\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nAssertionError: grads differ\n\n'
        "Process 1 exited with error code 10 and exception:\nValueError: other rank\n"
    )
    assert torch_suites.first_error_line(text) == "AssertionError: grads differ"
    peer_gone = text.replace("AssertionError: grads differ", "RuntimeError: [pair.cc:561] Connection closed by peer")
    assert torch_suites.first_error_line(peer_gone) == "ValueError: other rank"


def test_table_names_results_shims_and_counts():
    control = {"m.C.test_a": {"result": "pass"}, "m.C.test_b": {"result": "pass", "on_cpu": True}}
    tested = {"m.C.test_a": {"result": "FAIL", "error": "KeyError: x"},
              "m.C.test_b": {"result": "pass", "on_cpu": True, "shims": ["_all_params"]}}
    text = torch_suites.table(control, tested)
    assert "| C.test_a | pass | FAIL | KeyError: x |" in text
    assert "| C.test_b (on CPU) | pass | pass (shim _all_params) |  |" in text
    assert text.endswith("m: torch passes 2 of 2 that ran; minddp passes 1 of 2.\n"
                         "torch passes 2 of 2 that ran; minddp passes 1 of 2.")


def test_accelerator_devices_become_the_cpu():
    with patches.CpuDevices():
        made = torch.zeros(2, device=0)
        moved = torch.ones(1).to(1)
        named = torch.ones(1).to("cuda:1", torch.float64)
        module = torch.nn.Linear(2, 2).to(device=1)
    assert {made.device.type, moved.device.type, named.device.type, module.weight.device.type} == {"cpu"}
    assert named.dtype == torch.float64


def test_one_gpu_per_rank_is_retargeted_more_is_left_to_skip():
    calls = []
    skip_if_lt_x_gpu = patches.retarget_lt_x_gpu(lambda x, allow_cpu=False: calls.append(x) or (lambda f: f))
    seen = []

    @skip_if_lt_x_gpu(2)
    def test(x):
        torch.accelerator.set_device_index(1)  # a no-op while retargeted
        seen.append(torch.ones(1, device=x).device.type)

    before = torch.accelerator.set_device_index
    test(0)
    assert seen == ["cpu"] and test.retargeted_to_cpu and torch.accelerator.set_device_index is before
    skip_if_lt_x_gpu(4)
    assert calls == [4]


def test_device_ids_are_dropped_for_a_module_on_the_cpu():
    class RecordingDDP:
        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            self.device_ids, self.output_device, self.kwargs = device_ids, output_device, kwargs

    wrapped = patches.cpu_ddp(RecordingDDP)(torch.nn.Linear(1, 1), device_ids=[0], output_device=0, static_graph=True)
    assert (wrapped.device_ids, wrapped.output_device, wrapped.kwargs) == (None, None, {"static_graph": True})
    assert patches.cpu_ddp(RecordingDDP).__name__ == "RecordingDDP"


def test_tests_needing_an_accelerator_backend_skip_without_one():
    @patches.needs_accelerator_backend()
    def test():
        pass

    assert getattr(test, "__unittest_skip__", False) is (not torch.accelerator.is_available())


# ---------------------------------------------------------------- distributed_test.py: selection by reach
import classify  # noqa: E402
import distributed  # noqa: E402
import selection  # noqa: E402

FAKE_BASE = textwrap.dedent('''
    from torch.nn.parallel import DistributedDataParallel

    def make_bn_model():
        return nn.SyncBatchNorm(2)

    class DistributedTest:
        class _DistTestBase:
            def _wrap(self, model):
                return self._really_wrap(model)

            def _really_wrap(self, model):
                ddp = DistributedDataParallel(model)
                ddp._get_ddp_logging_data()
                return ddp

            def test_through_two_helpers(self):
                self._barrier()
                self._wrap(None)

            @skip_if_lt_x_gpu(2)
            def test_through_a_top_level_function(self):
                make_bn_model()

            def test_collective_only(self):
                dist.all_reduce(torch.ones(1))

            def test_sampler(self):
                torch.utils.data.distributed.DistributedSampler(range(4))
''')


def test_a_test_is_selected_when_its_code_or_a_helper_of_it_names_a_class_under_test():
    reaches = selection.reach_of_tests(FAKE_BASE, "_DistTestBase")
    assert selection.selected(reaches) == ["test_through_two_helpers", "test_through_a_top_level_function", "test_sampler"]
    assert reaches["test_through_two_helpers"].targets == {"DistributedDataParallel"}
    assert reaches["test_through_a_top_level_function"].targets == {"SyncBatchNorm"}
    assert reaches["test_sampler"].targets == {"DistributedSampler"}
    assert not reaches["test_collective_only"].targets


def test_reach_also_gives_private_names_not_of_self_and_the_gpu_mark():
    reaches = selection.reach_of_tests(FAKE_BASE, "_DistTestBase")
    assert reaches["test_through_two_helpers"].private_names == {"_get_ddp_logging_data"}  # not self._barrier
    assert [name for name, r in reaches.items() if r.gpu_decorated] == ["test_through_a_top_level_function"]


def test_k_takes_several_parts_and_an_exact_end():
    assert selection.matches("m.C.test_a", None) and selection.matches("m.C.test_a", "nope,test_")
    assert selection.matches("m.C.test_a", ".test_a$") and not selection.matches("m.C.test_a_b", ".test_a$")
    assert not selection.matches("m.C.test_a", "other")


# ---------------------------------------------------------------- classification
PRIVATE = frozenset({"_get_ddp_logging_data", "_get_local_used_map"})


def row(result, error="", **extra):
    return {"test": "distributed_test.C.test_x", "result": result, "error": error, **extra}


def kind(torch_row, minddp_row, documented=None):
    return classify.classify(torch_row, minddp_row, documented or {}, PRIVATE)


def test_kinds_when_torch_does_not_pass():
    assert kind(row("pass"), row("pass"))[0] == "pass both"
    assert kind(row("FAIL", "ValueError: GPU only"), row("FAIL"))[0] == "fail both"
    assert kind(row("FAIL", "ValueError: GPU only"), row("pass")) == ("minddp only", "torch: ValueError: GPU only")
    assert kind(row("skip", "Need 4 GPUs"), row("skip", "Need 4 GPUs")) == ("skip", "Need 4 GPUs")
    assert kind(row("pass"), None)[0] == "not run"


def test_a_failure_on_a_missing_torch_private_name_is_named_by_either_witness():
    traceback = "AttributeError: 'Reducer' object has no attribute '_get_local_used_map'"
    by_traceback = row("FAIL", traceback, traceback=traceback)
    assert kind(row("pass"), by_traceback) == ("torch-private", "_get_local_used_map")
    recorded = row("FAIL", "AssertionError: x", missing=["MiniDDP._get_ddp_logging_data"],
                   private_in_code=["_get_ddp_logging_data"])
    assert kind(row("pass"), recorded) == ("torch-private", "_get_ddp_logging_data")


def test_a_private_name_only_probed_by_a_library_is_not_the_cause():
    probed = row("FAIL", "AssertionError: grads differ", missing=["MiniDDP._get_ddp_logging_data"])
    assert kind(row("pass"), probed) == ("defect", "AssertionError: grads differ")
    not_torchs = row("FAIL", "AttributeError: no attribute '_mine'", traceback="has no attribute '_mine'")
    assert kind(row("pass"), not_torchs)[0] == "defect"


def test_a_documented_difference_counts_only_with_the_error_it_documents():
    documented = {"test_x": ("RuntimeError: MiniDDP: parameters", "earlier error, documented")}
    assert kind(row("pass"), row("FAIL", "RuntimeError: MiniDDP: parameters [w]"), documented) == \
        ("documented", "earlier error, documented")
    assert kind(row("pass"), row("FAIL", "AssertionError: other"), documented)[0] == "defect"


def test_report_counts_public_behaviour_tests_and_lists_every_failure():
    def rows(*results):
        return {f"distributed_test.C.test_{i}": dict(row(r, "E"), test=f"distributed_test.C.test_{i}")
                for i, r in enumerate(results)}

    control = rows("pass", "pass", "pass", "FAIL", "skip")
    tested = rows("pass", "FAIL", "FAIL", "pass", "skip")
    tested["distributed_test.C.test_2"].update(traceback="has no attribute '_get_ddp_logging_data'")
    text = classify.report(control, tested)
    assert "| distributed_test.py | 3 / 1 / 1 | 2 / 2 / 1 |" in text
    assert "Public-behaviour tests torch passes: 2; minddp passes 1 of them." in text
    assert "| test_1 | defect | E |" in text and "| test_2 | torch-private | _get_ddp_logging_data |" in text
    assert "- `_get_ddp_logging_data`: 1" in text


# ---------------------------------------------------------------- the class under test, per test
def test_recording_class_logs_the_private_names_it_lacks_and_changes_nothing_else(tmp_path, monkeypatch):
    log = tmp_path / "missing.log"
    monkeypatch.setenv(distributed.MISSING_LOG_ENV, str(log))
    monkeypatch.setenv(patches.CURRENT_TEST_ENV, "t1")
    Watched = distributed.recording(torch.nn.Linear)
    layer = Watched(2, 2)
    assert layer.weight.shape == (2, 2) and isinstance(layer, torch.nn.Linear)
    with pytest.raises(AttributeError):
        layer._torch_private()
    with pytest.raises(AttributeError):
        Watched._set_params_and_buffers_to_ignore_for_model(layer, [])
    with pytest.raises(AttributeError):
        layer.public_missing
    assert log.read_text().splitlines() == ["t1\tLinear._torch_private", "t1\tLinear._set_params_and_buffers_to_ignore_for_model"]


def test_only_the_classes_a_test_reaches_are_minddps(monkeypatch):
    import minddp
    import torch.nn.parallel
    import torch.utils.data

    for owner, name in ((torch.nn.parallel, "DistributedDataParallel"), (torch.nn, "SyncBatchNorm"),
                        (torch.utils.data, "DistributedSampler")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    suite = type("FakeSuite", (), {"DistributedSampler": None, "DistributedDataParallel": None})
    got = distributed.use_classes(suite, "minddp", {"DistributedSampler"})
    assert got == {"DistributedDataParallel": "torch", "SyncBatchNorm": "torch", "DistributedSampler": "minddp"}
    assert issubclass(suite.DistributedSampler, minddp.DistributedSampler)
    assert issubclass(suite.DistributedDataParallel, torch.nn.parallel.distributed.DistributedDataParallel)
    assert torch.nn.SyncBatchNorm is torch.nn.modules.SyncBatchNorm
    assert set(distributed.use_classes(suite, "torch", set(selection.TARGETS)).values()) == {"torch"}


def test_cuda_device_calls_do_nothing_in_a_test_moved_to_the_cpu():
    before = torch.cuda.synchronize, torch.cuda.current_device

    @patches.on_cpu
    def test():
        torch.cuda.synchronize(device=1)
        return torch.ones(1, device=torch.cuda.current_device()).device.type

    assert test() == "cpu" and (torch.cuda.synchronize, torch.cuda.current_device) == before


def test_report_goes_between_the_documents_markers(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n<!-- torch_suites --report: begin -->\nold\n<!-- torch_suites --report: end -->\nafter\n")
    torch_suites.write_into(doc, "| new |")
    assert doc.read_text() == ("intro\n<!-- torch_suites --report: begin -->\n| new |\n"
                               "<!-- torch_suites --report: end -->\nafter\n")
    with pytest.raises(SystemExit, match="no"):
        torch_suites.write_into(_empty(tmp_path), "x")


def test_a_report_for_a_document_names_its_command_before_each_table():
    rows = {"distributed_test.C.test_a": row("pass")}
    text = classify.report(rows, rows, "Made by `python x`:")
    lines = text.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("| ") and not lines[i - 1].startswith("|")]
    assert len(tables) == 3 and all(lines[i - 2:i] == ["Made by `python x`:", ""] for i in tables)


def _empty(tmp_path):
    path = tmp_path / "empty.md"
    path.write_text("nothing marked\n")
    return path


def test_an_attribute_torch_sets_on_its_ddp_without_documenting_it_counts_as_torch_private():
    undocumented = classify.undocumented_ddp_attributes()
    assert "bucket_bytes_cap_list" in undocumented and "module" not in undocumented
    missing = row("FAIL", "AttributeError: x", traceback="'MiniDDP' object has no attribute 'bucket_bytes_cap_list'")
    assert classify.classify(row("pass"), missing, {}, undocumented) == \
        ("torch-private", "bucket_bytes_cap_list (undocumented attribute)")
