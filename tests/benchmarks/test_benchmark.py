"""benchmarks/compare.py --quick runs end to end and writes the promised JSON.

A smoke test: it checks that every field is there and that MiniDDP and
torch's DDP end the run with the same parameters. It asserts nothing about
timings (those depend on the machine and its load). The same run exercises
``--runs``, ``--trace`` and ``--learned-order`` (one run keeps the suite
fast). The statistics over rounds and runs are checked on made-up block
times, without processes.
"""

import contextlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARE = os.path.join(ROOT, "benchmarks", "compare.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from benchlib import bound  # noqa: E402
from benchlib import spread  # noqa: E402
from minddp_lab.trace_view import read_steps  # noqa: E402

WRAPPERS = [f"{impl}_{view}" for impl in ("torch", "minddp") for view in ("copy", "view")]
SPREAD = [f"ratio_{v}" for v in ("copy", "view", "auto")] + [f"overhead_{w}_ms" for w in WRAPPERS]
SPREAD += [f"overhead_gap_{v}_ms" for v in ("copy", "view")]
SPREAD += ["bound_ms"] + [f"{k}_{w}{u}" for w in [*WRAPPERS, "minddp_auto"] for k, u in (("over_bound", "_ms"), ("x_bound", ""))]
SPREAD += [f"hidden_fraction_{w}" for w in [*WRAPPERS, "minddp_auto"]]
AUTO_FIELDS = {"minddp_auto_ms", "peak_mem_minddp_auto_mb", "auto_buckets", "auto_predicted_ms",
               "max_param_diff_auto"}  # plan_buckets(MiniDDP(...)) against torch_copy
RESULT_FIELDS = {
    "model", "backend", "device", "world_size", "bucket_cap_mb", "runs",
    "local_ms", "forward_ms", "allreduce_ms", "ideal_ms", "naive_ms", "max_param_diff", "per_run",
    *(f"{w}_ms" for w in WRAPPERS), *(f"{w}_nocomm_ms" for w in WRAPPERS),
    *(f"peak_mem_{w}_mb" for w in WRAPPERS), "peak_mem_windows_mb", "predicted_ms",
    *(f"overhead_{w}_fraction" for w in WRAPPERS), "allreduce_flat_ms", "bound_rule",
    *(f"over_bound_{w}_fraction" for w in [*WRAPPERS, "minddp_auto"]),
    *SPREAD, *(f"{k}_min" for k in SPREAD), *(f"{k}_max" for k in SPREAD), *AUTO_FIELDS,
}  # fmt: skip
LEARNED_ORDER_FIELDS = {
    "model", "bucket_cap_mb", "local_ms", "allreduce_ms", "learned_ms", "registration_ms", "ratio",
    "hidden_fraction_learned", "hidden_fraction_registration", "buckets_learned", "buckets_registration",
    "launched_before_last_hook_learned", "launched_before_last_hook_registration",
}  # fmt: skip
TRACE_STEPS = 3  # compare.TRACE_STEPS
MODELS = ["mlp", "ae", "gpt"]  # the smoke test's: a large, a small and the transformer
RUNS = 1  # the fields and the agreement are what is checked; spreads over runs are compare.py --runs N's


@pytest.mark.timeout(480)  # every row in processes of its own: 263 s of it under two busy loops
def test_quick_run_writes_every_field_and_the_wrappers_agree(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, COMPARE, "--quick", "--runs", str(RUNS), "--models", ",".join(MODELS),
         "--json", str(out), "--trace", str(tmp_path / "trace.json"), "--learned-order"],  # fmt: skip
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=450,
    )
    assert proc.returncode == 0, f"compare.py --quick failed:\n{proc.stdout}\n{proc.stderr}"
    assert "| model" in proc.stdout and "Wrapper overhead" in proc.stdout  # the tables were printed
    assert "ratio auto" in proc.stdout  # the column
    # why: the planner's decision once per model (not once per run and row); not a terminal, so one
    # progress line per model and run (not one per round), then the memory run and the end
    assert proc.stderr.count("MiniDDP plan_buckets") == len(MODELS), proc.stderr
    assert proc.stderr.count("gpt, cap 25 MB (") == RUNS and "round" not in proc.stderr, proc.stderr
    assert proc.stderr.count("peak memory (") == 1 and "\r" not in proc.stderr, proc.stderr
    # the summary comes first, one line per model with a verdict, then the tables
    assert proc.stdout.lstrip().startswith("Summary"), proc.stdout[:400]
    summary = proc.stdout[: proc.stdout.index("| model")]
    for model in MODELS:
        assert sum(line.lstrip().startswith(model + " ") for line in summary.splitlines()) == 1, summary
    assert "simulated" in proc.stdout and "sim error torch" in proc.stdout  # the simulator beside each step
    assert "| bound (" in proc.stdout and "Against the bound" in proc.stdout  # the floor, and every wrapper as a multiple of it

    data = json.loads(out.read_text())
    assert set(data) == {"config", "results", "learned_order"}  # the last only with --learned-order
    assert data["config"]["quick"] is True and data["config"]["runs"] == RUNS
    results = data["results"]
    assert [r["model"] for r in results] == MODELS
    for r in results:
        assert set(r) == RESULT_FIELDS, f"fields differ: {set(r) ^ RESULT_FIELDS}"
        assert (r["backend"], r["device"], r["world_size"], r["runs"]) == ("gloo", "cpu", 2, RUNS)
        for key in RESULT_FIELDS - {"model", "backend", "device", "per_run", "bound_rule", "peak_mem_windows_mb"}:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
        assert r["ideal_ms"] == max(r["local_ms"], r["allreduce_ms"])
        # 2 ranks of 1 thread: with 4 cores or more Gloo's thread has one to spare.
        assert r["bound_rule"] == data["config"]["bound_rule"] == ("max" if os.cpu_count() >= 4 else "sum")
        assert r["bound_ms"] > 0 and r["allreduce_flat_ms"] > 0
        for key in SPREAD:
            assert len(r["per_run"][key]) == RUNS
            assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"], (key, r)
        for w in WRAPPERS:
            assert 0.0 <= r[f"hidden_fraction_{w}"] <= 1.0
            assert r[f"peak_mem_{w}_mb"] == min(r["peak_mem_windows_mb"][w]), w
        assert r["max_param_diff"] == 0.0, f"{r['model']}: MiniDDP and torch's DDP diverged by {r['max_param_diff']}"
        # Other buckets may sum in another order: float32 rounding, no more.
        assert r["max_param_diff_auto"] < 1e-5, f"{r['model']}: auto diverged by {r['max_param_diff_auto']}"
        assert len(r["per_run"]["auto_buckets"]) == RUNS and all(n >= 1 for n in r["per_run"]["auto_buckets"])
        assert r["ratio_auto"] == pytest.approx(statistics.median(r["per_run"]["ratio_auto"]))
    check_learned_order(data["learned_order"])
    check_traces(tmp_path, proc.stdout)
    shown = subprocess.run([sys.executable, COMPARE, "--show", str(out)], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "| gpt " in shown.stdout and "Wrapper overhead" in shown.stdout, shown.stderr
    assert "Against the bound" in shown.stdout and shown.stdout.startswith("Summary")


def test_overhead_is_paired_by_round_and_spread_is_over_runs():
    """Overhead subtracts the bare step of the *same round*: with drift between
    rounds that differs from subtracting medians. Ratios are taken within a
    run, then reported as median, min and max over runs. The bound pairs by
    round the same way."""
    cfg = {"backend": "gloo", "device": "cpu", "world_size": 2, "bucket_views": ["copy"], "bound_rule": "sum"}

    def run(scale: float) -> list[dict]:
        local = [10.0, 30.0, 50.0]  # the machine slowed down between rounds
        blocks = {
            "local": local, "allreduce": [5.0] * 3, "naive": [60.0] * 3, "allreduce_flat": [4.0] * 3,
            "torch_copy": [20.0, 40.0, 60.0], "minddp_copy": [20.0 * scale, 40.0 * scale, 60.0 * scale],
            "torch_copy_nocomm": [12.0, 31.0, 53.0], "minddp_copy_nocomm": [11.0, 30.5, 51.0],
        }  # fmt: skip
        return [{"model": "m", "bucket_cap_mb": 25.0, "block_ms": blocks, "max_param_diff": 0.0}]

    memory = [{"model": "m", "bucket_cap_mb": 25.0, "peak_mb": {"torch_copy": 1.0, "minddp_copy": 2.0}}]
    (row,) = spread.make_rows(cfg, [run(0.9), run(1.2), run(1.0)], memory)
    assert row["overhead_torch_copy_ms"] == 2.0  # rounds: 2, 1, 3 (medians would say 31 - 30 = 1)
    assert row["overhead_minddp_copy_ms"] == 1.0  # rounds: 1, 0.5, 1
    assert row["overhead_gap_copy_ms"] == -1.0  # rounds: -1, -0.5, -2
    assert row["overhead_torch_copy_fraction"] == 2.0 / 30.0
    assert row["per_run"]["ratio_copy"] == pytest.approx([0.9, 1.2, 1.0])
    assert (row["ratio_copy"], row["ratio_copy_min"], row["ratio_copy_max"]) == pytest.approx((1.0, 0.9, 1.2))
    assert row["runs"] == 3 and row["peak_mem_minddp_copy_mb"] == 2.0
    # The bound of each round is that round's local + flat all-reduce: 14, 34, 54.
    assert (row["bound_ms"], row["bound_rule"], row["allreduce_flat_ms"]) == (34.0, "sum", 4.0)
    assert row["per_run"]["over_bound_torch_copy_ms"] == [6.0, 6.0, 6.0]  # 20 - 14, 40 - 34, 60 - 54
    assert row["per_run"]["over_bound_minddp_copy_ms"] == pytest.approx([2.0, 14.0, 6.0])  # 40 * scale - 34
    assert (row["over_bound_minddp_copy_ms"], row["over_bound_minddp_copy_ms_min"],
            row["over_bound_minddp_copy_ms_max"]) == pytest.approx((6.0, 2.0, 14.0))
    assert row["over_bound_torch_copy_fraction"] == pytest.approx(6.0 / 34.0)


def test_bound_is_the_sum_without_a_spare_core_and_the_max_with_one():
    """2 ranks of 1 thread on 2 cores: Gloo's thread takes turns with backward, nothing overlaps."""
    assert bound.bound_rule("cpu", 2, 1, cpu_count=2) == "sum"
    assert bound.bound_rule("cpu", 2, 1, cpu_count=4) == "max"
    assert bound.bound_rule("cpu", 2, 2, cpu_count=4) == "sum"  # 2 compute threads per rank fill the cores
    assert bound.bound_rule("cuda", 8, 1, cpu_count=2) == "max"  # NCCL runs on the GPU's own streams
    blocks = {"local": [10.0, 12.0, 11.0], "allreduce_flat": [3.0, 20.0, 3.0], "torch_copy": [15.0, 25.0, 16.0]}
    summed = bound.bound_figures(blocks, "sum", ["torch_copy"])
    assert (summed["bound_ms"], summed["over_bound_torch_copy_ms"]) == (14.0, 2.0)  # rounds: 13, 32, 14; 2, -7, 2
    with pytest.raises(ValueError, match="forward"):  # the overlap bound needs the forward pass timed alone
        bound.bound_figures(blocks, "max", ["torch_copy"])
    # With overlap only backward (and the step) can hide the all-reduce: forward + max(local - forward, flat).
    blocks.update(forward=[4.0, 5.0, 4.0], allreduce_flat=[3.0, 20.0, 9.0])
    most = bound.bound_figures(blocks, "max", ["torch_copy"])
    assert (most["bound_ms"], most["over_bound_torch_copy_ms"]) == (13.0, 3.0)  # rounds: 10, 25, 13; 5, 0, 3
    assert bound.RULES["max"] == "forward + max(backward and step, allreduce_flat)"
    with pytest.raises(ValueError, match="bound rule"):
        bound.bound_figures(blocks, "min", [])


def test_ratio_auto_is_auto_over_torch_at_its_defaults():
    """plan_buckets(MiniDDP(...)) is set against torch's DDP with gradient_as_bucket_view=False."""
    blocks = {"local": [10.0], "allreduce": [5.0], "naive": [30.0], "torch_copy": [20.0], "minddp_copy": [21.0],
              "torch_view": [18.0], "minddp_view": [19.0], "minddp_auto": [17.0]}  # fmt: skip
    figures = spread.run_figures(blocks, ["copy", "view"])
    assert figures["ratio_auto"] == 17.0 / 20.0
    assert "ratio_auto" not in spread.run_figures({k: v for k, v in blocks.items() if k != "minddp_auto"}, ["copy"])


def test_the_25_mb_row_is_torchs_default_and_every_other_cap_is_given():
    """torch's DDP at its defaults has a 1 MiB first bucket; a cap given, even 25, makes the first bucket
    the cap too (torch's _BucketCapacityConfig): for these models, one bucket. The 25 MB row gives no cap."""
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    from benchlib.wrappers import bucket_sizes, cap_argument, first_bucket_mb
    from minddp.ddp.arguments import first_bucket_cap_mb

    MiB = 1024 * 1024
    for cap, first in ((25.0, 1.0), (5.0, 5.0), (0.25, 0.25)):
        torch_config = _BucketCapacityConfig.create(cap_argument(cap), None, use_python_reducer=False)
        assert torch_config.first_bucket_bytes_cap == int(first * MiB), (cap, torch_config)
        assert first_bucket_cap_mb(cap_argument(cap), None, cap) == first_bucket_mb(cap) == first, cap
    params = [torch.zeros(MiB // 2) for _ in range(4)]  # 2 MiB each: at the default, the first one alone
    assert bucket_sizes(params, 25.0) == [MiB // 2, 3 * MiB // 2]
    assert bucket_sizes(params, 5.0) == [3 * MiB // 2, MiB // 2]


def test_show_reads_a_json_written_before_the_bound(tmp_path, capsys):
    """A compare.json from before the bound column (docs/compare.json, its bound taken out) still prints."""
    data = json.loads(open(os.path.join(ROOT, "docs", "compare.json")).read())
    data["config"].pop("bound_rule", None)
    for row in data["results"]:
        for key in [k for k in row if "bound" in k or k.startswith("allreduce_flat")]:
            del row[key]
        row["per_run"] = {k: v for k, v in row["per_run"].items() if "bound" not in k}
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    import compare  # in this process: --show measures nothing, and a fresh interpreter costs seconds

    assert compare.main(["--show", str(old)]) == 0
    shown = capsys.readouterr().out
    assert "| cnn " in shown and "Wrapper overhead" in shown and "bound" not in shown


def test_plot_without_matplotlib_says_how_to_install(tmp_path):
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed; the hint only shows without it")
    except ImportError:
        pass
    proc = subprocess.run(
        [sys.executable, COMPARE, "--quick", "--plot", str(tmp_path / "x.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "pip install" in proc.stderr and "plot" in proc.stderr


def check_learned_order(rows: list[dict]) -> None:
    assert len(rows) == 1 and set(rows[0]) == LEARNED_ORDER_FIELDS, rows
    r = rows[0]
    assert (r["model"], r["bucket_cap_mb"]) == ("shuffled_mlp", 2.0)
    for key in LEARNED_ORDER_FIELDS - {"model"}:
        assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
    assert r["buckets_learned"] > 2 and r["buckets_registration"] > 2, "2 MB buckets split the 9.6 MiB model"
    # Not a timing: which buckets can leave before backward's last gradient
    # follows from the hook order. shuffled_mlp registers its input layer last,
    # so in reverse registration order its gradient (the last to come) is in
    # bucket 0, and strict bucket order holds every other bucket behind it.
    assert r["launched_before_last_hook_registration"] <= 1, r
    assert r["launched_before_last_hook_learned"] >= r["buckets_learned"] - 2, r


def check_traces(tmp_path, stdout: str) -> None:
    for model in MODELS:
        path = tmp_path / f"trace-{model}.json"  # several models: the name goes into the file name
        assert f"trace {model}: {path}" in stdout
        trace = json.loads(path.read_text())
        comm = [e for e in trace["traceEvents"] if e.get("tid") == 1 and e["ph"] == "X"]
        assert {e["pid"] for e in comm} == {0, 1}, f"{model}: communication events of both ranks"
        assert all(e["name"].startswith("all_reduce bucket ") and e["dur"] >= 0 for e in comm)
        steps = read_steps(trace)
        assert sorted(steps) == [0, 1]
        for rank, views in steps.items():
            assert len(views) == TRACE_STEPS, (model, rank, [v.step for v in views])
            for v in views:
                indices = [b.index for b in v.buckets]  # in launch order
                assert v.hooks and indices and indices == list(range(len(indices))), (model, v)


def test_read_steps_groups_bars_by_the_step_they_were_launched_in():
    """A bar belongs to the step it was launched in, even when it ends after
    that step's backward; bars of steps not in the trace are dropped."""

    def span(step, ts, dur):
        return {"name": "backward", "ph": "X", "pid": 0, "tid": 0, "ts": ts, "dur": dur, "args": {"step": step}}

    def hook(step, ts, name):
        return {"name": f"grad {name}", "ph": "i", "s": "t", "pid": 0, "tid": 0, "ts": ts, "args": {"step": step}}

    def bar(step, index, ts, dur):
        return {"name": f"all_reduce bucket {index}", "ph": "X", "pid": 0, "tid": 1, "ts": ts, "dur": dur,
                "args": {"step": step, "bytes": 4096}}  # fmt: skip

    events = [
        bar(1, 1, 50.0, 40.0),  # the step before the trace starts: dropped
        span(2, 100.0, 900.0), hook(2, 100.0, "b"), hook(2, 400.0, "w"),
        bar(2, 0, 150.0, 100.0), bar(2, 1, 450.0, 550.0),  # launched in step 2, ends after its backward
        span(3, 2000.0, 500.0), hook(3, 2000.0, "b"), hook(3, 2300.0, "w"),
        bar(3, 0, 2050.0, 100.0), bar(3, 1, 2350.0, 100.0),
    ]  # fmt: skip
    (views,) = read_steps({"traceEvents": events}).values()
    assert [(v.step, [b.index for b in v.buckets]) for v in views] == [(2, [0, 1]), (3, [0, 1])]
    first = views[0]
    assert first.hooks == [("b", 0.1), ("w", 0.4)] and first.last_hook_ms == 0.4
    assert (first.launched_before_last_hook(), first.finished_before_last_hook()) == (1, 1)
    assert "2 buckets, 1 launched and 1 finished before the last gradient hook" in first.summary()
    assert "then 0.6 ms waiting" in first.summary()


def test_link_option_parses_a_rate_or_loopback_and_sweeps_the_caps_on_a_link(capsys):
    import compare

    args = compare.parse_args(["--link", "1Gbit"])
    assert args.link == "1gbit" and args.bucket_sweep == [0.25, 1.0, 5.0, 25.0]
    assert compare.parse_args(["--link", "10gbit", "--bucket-sweep", "2"]).bucket_sweep == [2.0]
    assert compare.parse_args([]).link == "loopback" and compare.parse_args([]).bucket_sweep is None
    with pytest.raises(SystemExit):
        compare.parse_args(["--link", "1gbt"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "'1gbt' does not parse" in err and "100mbit" in err and "10gbit" in err and "loopback" in err
    # on a link the all-reduce waits on the wire: the bound is the max, whatever the cores
    assert bound.bound_rule("cpu", 2, 1, cpu_count=2, link="1gbit") == "max"


def test_hidden_fraction_comes_with_its_spread_over_runs_and_the_prediction_is_carried():
    cfg = {"backend": "gloo", "device": "cpu", "world_size": 2, "bucket_views": ["copy"], "bound_rule": "max"}

    def run(step: float) -> list[dict]:
        blocks = {"local": [10.0], "allreduce": [20.0], "naive": [30.0], "torch_copy": [step], "minddp_copy": [25.0]}
        return [{"model": "m", "bucket_cap_mb": 1.0, "block_ms": blocks, "max_param_diff": 0.0, "predicted_ms": step}]

    memory = [{"model": "m", "bucket_cap_mb": 1.0, "peak_mb": {"torch_copy": 1.0, "minddp_copy": 1.0}}]
    (row,) = spread.make_rows(cfg, [run(30.0), run(20.0), run(26.0)], memory)
    assert row["per_run"]["hidden_fraction_torch_copy"] == pytest.approx([0.0, 0.5, 0.2])  # (10 + 20 - t) / 20
    assert (row["hidden_fraction_torch_copy"], row["hidden_fraction_torch_copy_min"],
            row["hidden_fraction_torch_copy_max"]) == pytest.approx((0.2, 0.0, 0.5))  # fmt: skip
    assert row["hidden_fraction_minddp_copy"] == pytest.approx(0.25)
    assert row["predicted_ms"] == 26.0


def test_each_wrappers_peak_is_the_lowest_of_windows_taken_in_turns():
    """In about half of the windows Gloo's scratch memory for an all-reduce lands on backward's peak, for
    either wrapper (it once read as MiniDDP's bucket views holding 0.9 MiB more than torch's).
    So every wrapper's window is opened several times, the wrappers taking turns, and the lowest reading
    is its peak."""
    from benchlib import memory

    readings = {"torch_view": iter([49.1, 50.1, 49.1]), "minddp_view": iter([50.0, 50.1, 49.0])}
    order = []

    def measure(name: str) -> float:
        order.append(name)
        return next(readings[name])

    windows = memory.peak_windows(measure, ["torch_view", "minddp_view"], windows=3)
    assert order == ["torch_view", "minddp_view"] * 3
    assert windows == {"torch_view": [49.1, 50.1, 49.1], "minddp_view": [50.0, 50.1, 49.0]}
    assert memory.lowest(windows) == {"torch_view": 49.1, "minddp_view": 49.0}


def _settle_auto_then_step(rank, world_size, steps):
    """cnn (BatchNorm's buffers): ``auto`` settled by :meth:`Runner.settle`, then ``steps`` steps of it and
    of torch's DDP at its defaults, from the same weights."""
    from benchlib.timing import Runner
    from benchlib.wrappers import AUTO

    runner = Runner({"comm_hook": "none", "backend": "gloo"}, "cnn", 25.0, rank, world_size, torch.device("cpu"))
    auto, plain = runner.stepper(runner.wrapped(AUTO)), runner.stepper(runner.wrapped("torch_copy"))
    with contextlib.redirect_stdout(io.StringIO()):  # auto's decision line
        runner.settle(auto)
    restarted = all(torch.equal(p, runner.init_state[n]) for n, p in auto.module.module.named_parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            auto()
            plain()
    pairs = zip(auto.module.module.parameters(), plain.module.module.parameters())
    return restarted, [str(w.message) for w in caught if "MiniDDP" in str(w.message)], max(
        (a - b).abs().max().item() for a, b in pairs)


def test_settle_restarts_auto_from_the_starting_weights_and_leaves_the_buffers_alone(ranks):
    # Restoring BatchNorm's buffers between a backward and a forward is what buffer_sync="with_gradients"
    # warns about (the other ranks would get rank 0's old values): the benchmark must not do it.
    for restarted, minddp_warnings, diff in ranks(2).run(_settle_auto_then_step, 4, timeout_s=120):
        assert restarted and minddp_warnings == [], minddp_warnings
        assert diff < 1e-6, f"auto and torch's DDP diverged by {diff} after the same steps"


def test_auto_chooses_before_any_other_wrapper_has_stepped():
    """``auto`` times its proposals on real steps, so it chooses in the process as a user's script leaves
    it: no other model trained there yet. With the other wrappers warmed up first, mlp's trials on fast
    links kept one bucket (3 to 5% slower) in 14 of 30 runs; with none stepped, in 0 of 18."""
    from benchlib.timing import Runner

    runner = Runner.__new__(Runner)
    runner.cfg = {"warmup": 2}
    calls = []

    def stepper(name):
        def step():
            calls.append(name)
        return step

    runner.settle = lambda step: calls.append(f"settle {step.__name__}")
    steps = {}
    for name in ("torch@1", "minddp_auto", "torch@25"):
        steps[name] = stepper(name)
        steps[name].__name__ = name
    runner.warm_up(steps)
    assert calls[:3] == ["settle torch@1", "settle minddp_auto", "settle torch@25"]
    assert calls[3:] == ["torch@1", "torch@1", "minddp_auto", "minddp_auto", "torch@25", "torch@25"]


def test_every_row_of_compare_runs_in_processes_of_its_own(monkeypatch):
    """``auto`` chooses as in a user's script only where nothing else has trained in its process (the test
    above): ``compare.py`` starts fresh rank processes for every model and cap of every run, then the
    learned-order and trace extras in processes of their own, then the memory run."""
    import minddp_lab.links
    from benchlib import runs
    from benchlib.rank_work import extras_main, memory_main, timing_main

    spawned = []

    def fake_spawn(fn, world_size, cfg, out_path, **kw):
        spawned.append((fn.__name__, cfg.get("run"), cfg.get("case")))
        written = {timing_main: {"row": {"run": cfg.get("run"), "case": cfg.get("case")}},
                   extras_main: {"learned_order": [{"model": "shuffled"}]},
                   memory_main: {"memory": [], "method": "rss"}}[fn]
        with open(out_path, "w") as f:
            json.dump(written, f)

    monkeypatch.setattr(minddp_lab.links, "spawn", fake_spawn)
    cfg = {"models": ["mlp", "gpt"], "bucket_caps": [1.0, 25.0], "runs": 2, "repeats": 1, "world_size": 2,
           "backend": "gloo", "learned_order_cap_mb": 1.0, "trace_files": {}}
    with contextlib.redirect_stderr(io.StringIO()):
        timed, learned, peaks = runs.measure(cfg)
    rows = [("timing_main", run, case) for run in range(2) for case in range(4)]
    assert spawned == rows + [("extras_main", None, None), ("memory_main", None, None)]
    assert timed == [[{"run": run, "case": case} for case in range(4)] for run in range(2)]
    assert learned == [{"model": "shuffled"}] and peaks["memory"] == []

    spawned.clear()
    with contextlib.redirect_stderr(io.StringIO()):
        runs.measure({**cfg, "learned_order_cap_mb": None})  # no extras asked for: no processes for them
    assert spawned == rows + [("memory_main", None, None)]
