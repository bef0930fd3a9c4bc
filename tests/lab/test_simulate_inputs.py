"""The simulator's inputs: measured times, a network from flags or a measured table, the overheads, bad input.

Hand-computed replays with a 1 ms-per-step, 1 GB/s link, as in test_simulate.py. No process group
except the one ``--record module:function`` test (one spawned rank).
"""

import json
import math

import pytest

from minddp_lab.network import Hierarchy, Link, ring_allreduce_time
from minddp_lab.simulate import ComputeProfile, DDPPolicy, Gradient, simulate_step
from minddp_lab.simulate.__main__ import main
from minddp_lab.simulate.cluster import build_network, fit_network_table, lookup_network, network_table, parse_rate
from minddp_lab.simulate.overheads import ComputeClock, Overheads
from minddp_lab.simulate.profile import load_profile, save_profile

MB = 1_000_000
LINK = Link("hand", alpha_s=1e-3, bandwidth_Bps=1e9)
ONE_BUCKET = dict(bucket_cap_mb=25, first_bucket_cap_mb=25)


def profile():
    """Forward 2 ms; gradients ready at 2 and 6 ms of backward; 4 ms after backward: a 12 ms step."""
    return ComputeProfile(2.0, [Gradient("b", 2.0, 1 * MB), Gradient("a", 6.0, 1 * MB)], after_backward_ms=4.0)


def test_step_ms_keeps_the_shape_and_sets_the_length():
    p = profile().with_times(step_ms=6.0)  # half of 12 ms
    assert (p.forward_ms, *[g.ready_ms for g in p.gradients], p.after_backward_ms) == pytest.approx((1.0, 1.0, 3.0, 2.0))


def test_forward_and_backward_ms_scale_each_part_and_after_backward_goes_with_backward():
    p = profile().with_times(forward_ms=5.0, backward_ms=12.0)
    assert (p.forward_ms, *[g.ready_ms for g in p.gradients], p.after_backward_ms) == pytest.approx((5.0, 4.0, 12.0, 8.0))
    assert profile().with_times(forward_ms=5.0, backward_ms=12.0, after_backward_ms=1.0).after_backward_ms == 1.0


@pytest.mark.parametrize("kwargs, message", [
    (dict(step_ms=0.0), "step_ms must be"),
    (dict(step_ms=-2.0), "step_ms must be"),
    (dict(step_ms=5.0, forward_ms=1.0, backward_ms=2.0), "not both"),
    (dict(forward_ms=1.0), "go together"),
])
def test_measured_times_refuse_what_makes_no_sense(kwargs, message):
    with pytest.raises(ValueError, match=message):
        profile().with_times(**kwargs)


def test_per_step_cost_adds_to_the_step_at_every_world_size_one_included():
    o = Overheads(per_step_ms=3.0)
    for world in (1, 2):
        bare = simulate_step(profile(), LINK, world, DDPPolicy(**ONE_BUCKET))
        step = simulate_step(profile(), LINK, world, DDPPolicy(**ONE_BUCKET, overheads=o))
        assert step.step_ms == pytest.approx(bare.step_ms + 3.0) and step.per_step_ms == 3.0


def test_hook_and_launch_costs_are_inserted_into_backward_where_they_happen():
    # Two buckets ({b}, {a}); each gradient's hook costs 0.5 ms, each launch 1 ms.
    o = Overheads(per_gradient_us=500, per_bucket_us=1000)
    policy = DDPPolicy(bucket_cap_mb=1, first_bucket_cap_mb=1, overheads=o)
    one = simulate_step(profile(), LINK, 1, policy)
    # b ready at 2, hook to 2.5, launch to 3.5; a ready at 6 + 1.5 = 7.5, hook to 8, launch to 9.
    assert [b.start_ms for b in one.buckets] == pytest.approx([3.5, 9.0])
    assert one.hooks_ms == pytest.approx(3.0) and one.comm_ms == 0  # one rank: buckets, no wire time
    assert one.step_ms == pytest.approx(2 + 9 + 4)
    two = simulate_step(profile(), LINK, 2, policy)
    # each all-reduce: 2 ms latency + 1 MB / 1 GB/s = 3 ms; a's starts at 9, ends at 12
    assert [b.end_ms for b in two.buckets] == pytest.approx([6.5, 12.0])
    assert two.step_ms == pytest.approx(2 + 12 + 4)


def test_contention_takes_compute_per_megabyte_sent_while_backward_runs():
    # 2 ranks: each rank sends 1 MB per all-reduce of 1 MB; 500 us per MB: backward loses 0.5 ms to
    # b's all-reduce (2..5 ms, under backward); a's (6..9) runs after backward: nothing left to slow.
    policy = DDPPolicy(bucket_cap_mb=1, first_bucket_cap_mb=1, overheads=Overheads(contention_us_per_MB=500))
    step = simulate_step(profile(), LINK, 2, policy)
    assert step.contention_ms == pytest.approx(0.5)
    assert [b.start_ms for b in step.buckets] == pytest.approx([2.0, 6.5])
    assert step.step_ms == pytest.approx(2 + 9.5 + 4)


def test_compute_slowdown_stretches_backward_from_the_first_launch_on_and_not_on_one_rank():
    policy = DDPPolicy(bucket_cap_mb=1, first_bucket_cap_mb=1, overheads=Overheads(compute_slowdown=0.5))
    step = simulate_step(profile(), LINK, 2, policy)
    # 2 ms at full speed, then 4 ms of work at 2/3 speed: backward ends at 8; a's all-reduce 8..11
    assert step.backward_end_ms == pytest.approx(8.0) and step.contention_ms == pytest.approx(2.0)
    assert step.step_ms == pytest.approx(2 + 11 + 4)
    assert simulate_step(profile(), LINK, 1, policy).step_ms == pytest.approx(12.0)


def test_compute_clock_by_hand():
    clock = ComputeClock()
    clock.slow(1.0, 3.0, 0.5)  # 1 ms of work in 2 ms
    clock.slow(4.0, 5.0, 0.0)  # stopped
    assert [clock.wall(w) for w in (1.0, 1.5, 2.0, 3.0, 3.5)] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.5])
    assert clock.lost_ms(10.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="overlap"):
        clock.slow(4.5, 6.0, 0.5)


@pytest.mark.parametrize("field", ["per_step_ms", "per_gradient_us", "per_bucket_us", "contention_us_per_MB",
                                   "compute_slowdown"])
def test_overheads_must_be_numbers_at_least_zero(field):
    with pytest.raises(ValueError, match=field):
        Overheads(**{field: -1.0})
    with pytest.raises(ValueError, match=field):
        Overheads(**{field: math.nan})


def test_nics_shared_by_the_gpus_of_a_node_divide_between_them():
    net = build_network(LINK, latency_us=10, bandwidth_Bps=50e9, gpus_per_node=8, nics_per_node=4,
                        intra_bandwidth_Bps=100e9)
    assert isinstance(net, Hierarchy) and net.ranks_per_node == 8
    assert net.inter.bandwidth_Bps == pytest.approx(25e9) and net.inter.alpha_s == pytest.approx(10e-6)
    assert net.intra.bandwidth_Bps == pytest.approx(100e9)
    flat = build_network(LINK, nominal_Bps=parse_rate("400Gb/s"), efficiency=0.8, latency_us=5)
    assert isinstance(flat, Link) and flat.bandwidth_Bps == pytest.approx(40e9) and flat.alpha_s == pytest.approx(5e-6)


def test_presets_are_at_the_achieved_bandwidth_and_say_where_it_comes_from():
    assert lookup_network("nvlink4").bandwidth_Bps == pytest.approx(370e9)
    assert lookup_network("nvlink4", nominal=True).bandwidth_Bps == pytest.approx(450e9)
    assert "nccl-tests issue 212" in network_table()
    assert "preset nvlink4: 82% of 450" in lookup_network("nvlink4").source
    dgx1 = lookup_network("dgx1-v100")
    assert dgx1.inter.bandwidth_Bps == pytest.approx(12.5e9 * 4 / 8 * 0.96)  # 4 EDR NICs for 8 GPUs, 96% achieved


def nccl_table(link, world, sizes):
    head = [f"#  Rank {r} Group  0 Pid  1 on host device  {r} [0x00] Tesla V100" for r in range(world)]
    # out-of-place time first, then in-place (made 10% slower here: the fit must read the first)
    rows = [f"{n:>12} {n // 4:>12} float sum -1 {ring_allreduce_time(n, world, link) * 1e6:9.2f} 0.0 0.0 0 "
            f"{ring_allreduce_time(n, world, link) * 1.1e6:9.2f} 0.0 0.0 0" for n in sizes]
    return "\n".join(["# nThread 1 nGpus 1", *head, "#       size  count type redop root time algbw busbw", *rows])


def test_a_network_fitted_to_all_reduce_perf_output_recovers_latency_and_bandwidth():
    truth = Link("t", 20e-6, 40e9)
    link = fit_network_table(nccl_table(truth, 16, [2**k for k in range(16, 30, 2)]))
    assert link.alpha_s == pytest.approx(truth.alpha_s, rel=1e-3)
    assert link.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-3)
    with pytest.raises(ValueError, match="--fit-world"):
        fit_network_table("\n".join(nccl_table(truth, 4, [2**20, 2**24]).splitlines()[5:]))


@pytest.fixture
def trace_path(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(profile(), str(path))
    return str(path)


@pytest.mark.parametrize("argv, flag", [
    (["--compute-scale", "0"], "--compute-scale"),
    (["--compute-scale", "-2"], "--compute-scale"),
    (["--world", "0"], "--world"),
    (["--accumulation", "0"], "--accumulation"),
    (["--bucket-mb", "-1"], "--bucket-mb"),
    (["--step-ms", "0"], "--step-ms"),
    (["--bandwidth", "-5GB/s"], "--bandwidth"),
    (["--gpus-per-node", "0"], "--gpus-per-node"),
    (["--efficiency", "1.5", "--nominal-bandwidth", "100Gb/s"], "--efficiency"),
    (["--step-ms", "5", "--compute-scale", "2"], "--compute-scale"),
    (["zero", "--tflops", "0"], "--tflops"),
    (["zero", "--world", "0"], "--world"),
])
def test_bad_input_gets_one_line_naming_the_flag(trace_path, capsys, argv, flag):
    args = argv if argv[0] == "zero" else ["--trace", trace_path, *argv]
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and flag in err and "Traceback" not in err, err


def test_command_with_measured_times_and_a_network_from_flags(trace_path, capsys):
    assert main(["--trace", trace_path, "--step-ms", "6", "--latency-us", "1000", "--bandwidth", "1GB/s",
                 "--world", "2", "--bucket-mb", "25", "--overheads", "none"]) == 0
    out = capsys.readouterr().out
    assert "forward 1.00 ms, backward 3.00 ms, after backward 2.00 ms" in out and "--step-ms 6" in out
    # b (1 MB, the first bucket) all-reduced 1..4 ms, a 4..7 (2 ms latency + 1 ms each): step 1 + 7 + 2 = 10 ms
    row = [line for line in out.splitlines() if line.startswith("| 2 |")][0]
    assert row.split("|")[4].strip() == "10.00"


def test_record_your_own_model_from_a_file(tmp_path):
    builder = tmp_path / "mine.py"
    builder.write_text("import torch\n\ndef build():\n    torch.manual_seed(0)\n"
                       "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)), torch.randn(4, 8)\n")
    from minddp_lab.simulate.record import record_trace

    out = tmp_path / "trace.json"
    record_trace(f"{builder}:build", str(out), steps=2, warmup=1)
    p = load_profile(str(out))
    assert sorted(g.nbytes for g in p.gradients) == [8, 64, 128, 512]  # biases 2, 16; weights 16x2, 8x16 floats
    with pytest.raises(ValueError, match="has no function 'nope'"):
        record_trace(f"{builder}:nope", str(out))
    with pytest.raises(ValueError, match="module:function"):
        record_trace("not-a-model", str(out))


def test_a_saved_profile_reads_back_the_same(trace_path):
    p = load_profile(trace_path)
    assert (p.forward_ms, p.after_backward_ms, [(g.name, g.ready_ms, g.nbytes) for g in p.gradients]) == (
        2.0, 4.0, [("b", 2.0, MB), ("a", 6.0, MB)])
    json.loads(open(trace_path).read())  # plain JSON


def test_command_fits_both_levels_to_measured_tables(tmp_path, capsys, trace_path):
    inter, intra = Link("net", 20e-6, 10e9), Link("nvlink", 4e-6, 100e9)
    sizes = [2**k for k in range(16, 30, 2)]
    (tmp_path / "inter.txt").write_text(nccl_table(inter, 4, sizes))
    (tmp_path / "intra.txt").write_text(nccl_table(intra, 8, sizes))
    assert main(["--trace", trace_path, "--fit-table", str(tmp_path / "inter.txt"), "--intra-fit-table",
                 str(tmp_path / "intra.txt"), "--gpus-per-node", "8", "--nics-per-node", "8", "--world", "16"]) == 0
    out = capsys.readouterr().out
    assert "between nodes, per NIC: 10 GB/s (fit --fit-table inter.txt), 20 us per step (fit --fit-table inter.txt)" in out
    assert "100 GB/s (fit --intra-fit-table intra.txt), 4 us per step (fit --intra-fit-table intra.txt)" in out, out
    assert main(["--trace", trace_path, "--fit-table", str(tmp_path / "missing.txt")]) == 2
    assert "--fit-table: cannot read" in capsys.readouterr().err


def test_command_records_your_model_and_predicts_from_your_step_time(tmp_path, capsys):
    builder = tmp_path / "mine.py"
    builder.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(64, 64), torch.randn(8, 64)\n")
    assert main(["--record", f"{builder}:build", "--out", str(tmp_path / "t.json"), "--step-ms", "10",
                 "--network", "dgx1-v100", "--world", "1,16", "--bucket-mb", "25"]) == 0
    out = capsys.readouterr().out
    assert "--step-ms 10" in out and "2 gradients" in out
    assert [line.split("|")[5].strip() for line in out.splitlines() if line.startswith("| 1")] == ["10.00", "10.00"]


def test_a_network_fitted_to_this_machines_benchmark_json():
    truth = Link("t", 700e-6, 1.6e9)
    sizes = [4096 * 4**k for k in range(7)]
    text = json.dumps({"fit": {"sizes": sizes, "median_ms": [ring_allreduce_time(n, 2, truth) * 1e3 for n in sizes]}})
    link = fit_network_table(text, world_size=2)
    assert link.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6)
    with pytest.raises(ValueError, match="median_ms"):
        fit_network_table(json.dumps({"rows": []}), world_size=2)


def test_fit_table_prints_each_rows_residual(tmp_path, capsys, trace_path):
    truth = Link("net", 20e-6, 10e9)
    sizes = [2**k for k in range(16, 30, 2)]
    text = nccl_table(truth, 4, sizes).splitlines()
    text[-1] = text[-1].replace(f"{ring_allreduce_time(sizes[-1], 4, truth) * 1e6:9.2f}",
                                f"{ring_allreduce_time(sizes[-1], 4, truth) * 1.5e6:9.2f}", 1)  # one row off the line
    (tmp_path / "t.txt").write_text("\n".join(text))
    assert main(["--trace", trace_path, "--fit-table", str(tmp_path / "t.txt"), "--world", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()
            and len(line.split("|")) == 6]
    assert [int(r.split("|")[1]) for r in rows] == sizes
    residuals = [float(r.split("|")[4].strip().rstrip("%")) for r in rows]
    assert abs(residuals[-1]) == max(abs(x) for x in residuals) and abs(residuals[-1]) > 5
