"""The step-time simulator: hand-computable replays, reading a trace, the network model, the command, lesson 17.

No process group anywhere except lesson 17's own two ranks (run as a subprocess).
Times: profiles in ms, links in seconds and bytes/s, as in the package.
"""

import json
import os
import subprocess
import sys

import pytest

from minddp_lab.network import (
    Hierarchy,
    Link,
    allreduce_time,
    fit_link,
    get_network,
    hierarchical_allreduce_time,
    ring_allreduce_time,
    ring_bytes_sent_per_rank,
)
from minddp_lab.simulate import ComputeProfile, DDPPolicy, Gradient, profile_from_trace, simulate_step

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1_000_000
MiB = 1024 * 1024
# 1 ms per ring step, 1 GB/s: a 1 MB all-reduce over 2 ranks is 2 x 1 ms + 1 MB / 1 GB/s = 3 ms.
LINK = Link("hand", alpha_s=1e-3, bandwidth_Bps=1e9)


def grad(name, ready_ms, nbytes, dtype="torch.float32"):
    return Gradient(name, ready_ms, nbytes, dtype)


def test_one_bucket_two_ranks_exact_step_time():
    profile = ComputeProfile(forward_ms=1.0, gradients=[grad("w", 2.0, 1 * MB)], after_backward_ms=0.5)
    step = simulate_step(profile, LINK, 2, DDPPolicy(bucket_cap_mb=25, first_bucket_cap_mb=25))
    assert len(step.buckets) == 1
    b = step.buckets[0]
    assert (b.ready_ms, b.start_ms, b.end_ms) == pytest.approx((2.0, 2.0, 5.0))
    # forward 1 + backward until the all-reduce ends at 5 ms + 0.5 ms optimizer
    assert step.step_ms == pytest.approx(6.5)
    assert step.compute_ms == pytest.approx(3.5)
    assert step.exposed_ms == pytest.approx(3.0)  # all of it after the last gradient
    assert step.hidden_fraction == pytest.approx(0.0)
    assert step.scaling_efficiency == pytest.approx(3.5 / 6.5)


def test_buckets_leave_in_order_one_at_a_time_and_hide_under_backward():
    # Arrival order c, b, a. First bucket capped at 1 MiB: {c}; then cap 2 MiB: {b}, {a}.
    grads = [grad("c", 1.0, 1 * MB), grad("b", 2.0, 2 * MB), grad("a", 10.0, 1 * MB)]
    step = simulate_step(ComputeProfile(0.0, grads), LINK, 2, DDPPolicy(bucket_cap_mb=2 / 1.048576))
    spans = [t for b in step.buckets for t in (b.ready_ms, b.start_ms, b.end_ms)]
    # c: 1..4; b ready at 2 but the wire is busy until 4: 4..8 (2 ms + 2 ms); a: 10..13
    assert spans == pytest.approx([1, 1, 4, 2, 4, 8, 10, 10, 13])
    assert step.step_ms == pytest.approx(13.0)
    assert step.comm_ms == pytest.approx(3 + 4 + 3)
    assert step.exposed_ms == pytest.approx(3.0)
    assert step.hidden_fraction == pytest.approx(0.7)


def test_per_parameter_buckets_pay_the_latency_once_each():
    grads = [grad(f"p{i}", float(i), 1000) for i in range(10)]
    tiny = simulate_step(ComputeProfile(0.0, grads), LINK, 8, DDPPolicy(bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001))
    one = simulate_step(ComputeProfile(0.0, grads), LINK, 8, DDPPolicy(bucket_cap_mb=25))
    assert len(tiny.buckets) == 10 and len(one.buckets) == 1
    assert tiny.comm_ms == pytest.approx(10 * ring_allreduce_time(1000, 8, LINK) * 1e3)
    assert one.comm_ms == pytest.approx(ring_allreduce_time(10_000, 8, LINK) * 1e3)


def test_fp16_compression_halves_the_bytes_and_pays_a_cast():
    profile = ComputeProfile(0.0, [grad("w", 0.0, 4 * MB)])
    policy = DDPPolicy(bucket_cap_mb=25, first_bucket_cap_mb=25, compression="fp16", cast_Bps=8e9)
    b = simulate_step(profile, LINK, 2, policy).buckets[0]
    assert b.wire_bytes == 2 * MB
    # 2 ms latency + 2 MB / 1 GB/s = 4 ms on the wire, plus two casts of 4 MB at 8 GB/s = 1 ms
    assert b.end_ms - b.start_ms == pytest.approx(5.0)
    already_half = ComputeProfile(0.0, [grad("w", 0.0, 4 * MB, "torch.float16")])
    assert simulate_step(already_half, LINK, 2, policy).buckets[0].wire_bytes == 4 * MB


def test_no_sync_accumulation_communicates_once_per_optimizer_step():
    profile = ComputeProfile(forward_ms=1.0, gradients=[grad("w", 2.0, 1 * MB)], after_backward_ms=0.5)
    step = simulate_step(profile, LINK, 2, DDPPolicy(bucket_cap_mb=25, first_bucket_cap_mb=25, accumulation_steps=4))
    # three micro-steps of forward 1 + backward 2 without communication, then the 6.5 ms synced step
    assert step.step_ms == pytest.approx(3 * 3.0 + 6.5)
    assert step.compute_ms == pytest.approx(3 * 3.0 + 3.5)
    assert step.scaling_efficiency == pytest.approx(12.5 / 15.5)


def test_world_one_has_no_communication():
    profile = ComputeProfile(1.0, [grad("w", 2.0, 1 * MB)], after_backward_ms=0.5)
    step = simulate_step(profile, LINK, 1, DDPPolicy())
    assert step.comm_ms == 0 and step.step_ms == pytest.approx(3.5) and step.scaling_efficiency == 1.0


def test_shared_cores_pause_backward_while_a_collective_runs():
    # Same as the in-order test, but communication and compute share one core:
    # c's all-reduce (1..4) pauses backward, so b is ready at 2 + 3 = 5 and a at 13.
    grads = [grad("c", 1.0, 1 * MB), grad("b", 2.0, 2 * MB), grad("a", 10.0, 1 * MB)]
    policy = DDPPolicy(bucket_cap_mb=2 / 1.048576, overlap=False)
    step = simulate_step(ComputeProfile(0.0, grads), LINK, 2, policy)
    spans = [t for b in step.buckets for t in (b.ready_ms, b.start_ms, b.end_ms)]
    assert spans == pytest.approx([1, 1, 4, 5, 5, 9, 17, 17, 20])
    assert step.backward_end_ms == pytest.approx(17.0)
    assert step.step_ms == pytest.approx(20.0)  # = compute 10 + all communication 10: nothing hidden
    assert step.hidden_fraction == pytest.approx(0.0)


def _event(name, ph, ts_us, step, pid=0, tid=0, dur=None, args=None):
    e = {"name": name, "ph": ph, "ts": ts_us, "pid": pid, "tid": tid, "args": {"step": step, **(args or {})}}
    if dur is not None:
        e["dur"] = dur
    return e


def synthetic_trace(steps=2):
    """Forward 0..1 ms, hooks at 3 ms (b) and 4 ms (a), grads written at 4.5 ms, next step 6 ms later."""
    events = []
    for s in range(steps):
        t0 = s * 6000.0
        events.append(_event("forward", "X", t0, s, dur=1000.0))
        events.append(_event("grad b", "i", t0 + 3000, s, args={"bytes": 400, "dtype": "torch.float32"}))
        events.append(_event("grad a", "i", t0 + 4000, s, args={"bytes": 200, "dtype": "torch.float16"}))
        events.append(_event("backward (first hook .. grads written)", "X", t0 + 3000, s, dur=1500.0))
        events.append(_event("all_reduce bucket 0", "X", t0 + 4000, s, tid=1, dur=300.0, args={"bytes": 600}))
    return {"traceEvents": events}


def test_the_older_rule_closes_a_bucket_before_the_cap():
    # the simulator's default (its checked tables were made with it): never past the cap, unless one tensor alone is
    import torch

    from minddp.ddp.core.assignment import TensorSpec
    from minddp_lab.simulate.bucket_rule import buckets_within_cap

    def spec(numel):
        return TensorSpec(numel, 4, torch.float32, torch.device("cpu"))

    assert buckets_within_cap([spec(25)] * 4, cap_bytes=250) == [[0, 1], [2, 3]]
    assert buckets_within_cap([spec(10), spec(1000), spec(10), spec(10)], cap_bytes=100) == [[0], [1], [2, 3]]
    assert buckets_within_cap([spec(25)] * 6, 1024, first_cap_bytes=100) == [[0], [1, 2, 3, 4, 5]]
    # mixed dtypes fill buckets of their own
    half = TensorSpec(50, 2, torch.float16, torch.device("cpu"))
    assert buckets_within_cap([spec(25), half, spec(25)], 200) == [[0, 2], [1]]


def test_profile_from_trace_reads_forward_ready_times_sizes_and_dtypes():
    p = profile_from_trace(synthetic_trace())
    assert p.forward_ms == pytest.approx(1.0)
    assert [(g.name, g.ready_ms, g.nbytes, g.dtype) for g in p.gradients] == [
        ("b", pytest.approx(2.0), 400, "torch.float32"),
        ("a", pytest.approx(3.0), 200, "torch.float16"),
    ]
    assert p.after_backward_ms == pytest.approx(2.0)  # last hook at 4 ms, next forward at 6 ms
    assert p.backward_ms == pytest.approx(3.0)
    one = profile_from_trace(synthetic_trace(steps=1))
    assert one.after_backward_ms == pytest.approx(0.5)  # no next step: last hook to grads written


def test_mixed_dtypes_go_to_separate_buckets():
    p = profile_from_trace(synthetic_trace())
    step = simulate_step(p, LINK, 2, DDPPolicy())
    assert sorted(b.nbytes for b in step.buckets) == [200, 400]


def test_hierarchical_all_reduce_is_an_intra_ring_plus_an_inter_ring_on_a_shard():
    intra, inter = Link("i", 1e-6, 100e9), Link("o", 1e-5, 10e9)
    net = Hierarchy("h", intra, inter, ranks_per_node=4)
    n = 8e6
    expected = (6 * 1e-6 + 1.5 * n / 100e9) + (2 * 7 * 1e-5 + 2 * 7 / 8 * (n / 4) / 10e9)
    assert hierarchical_allreduce_time(n, 32, net) == pytest.approx(expected)
    assert allreduce_time(n, 32, net) == pytest.approx(expected)
    assert allreduce_time(n, 4, net) == pytest.approx(ring_allreduce_time(n, 4, intra))  # one node
    assert isinstance(get_network("dgx-h100"), Hierarchy) and isinstance(get_network("ib400"), Link)


def test_fit_link_recovers_alpha_and_bandwidth():
    truth = Link("t", 7e-5, 2.5e8)
    sizes = [4e3, 64e3, 1e6, 16e6]
    link = fit_link(sizes, [ring_allreduce_time(n, 2, truth) for n in sizes], 2)
    assert link.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(truth.bandwidth_Bps, rel=1e-6)


def test_ring_traffic_per_rank_stays_under_twice_the_bytes():
    assert ring_bytes_sent_per_rank(1000, 2) == 1000
    assert ring_bytes_sent_per_rank(1000, 1024) == pytest.approx(2000 * 1023 / 1024)


def run_python(args, timeout=180):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_command_prints_a_table_per_world_size_and_bucket_cap(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(synthetic_trace()))
    out = run_python(["-m", "minddp_lab.simulate", "--trace", str(path), "--network", "eth25", "--world", "2,64",
                      "--bucket-mb", "1,25"])
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("|") and line[2:3].isdigit()]
    assert len(rows) == 4, out.stdout
    bad = run_python(["-m", "minddp_lab.simulate", "--trace", str(path), "--network", "nope"])
    assert bad.returncode != 0 and "--network must be one of" in bad.stderr


def test_lesson_17_runs_and_checks_its_claims():
    out = run_python([os.path.join("lessons", "17_how_ddp_scales.py")], timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "checked" in out.stdout
    assert "VGG-16 comes out within" in out.stdout  # at TensorFlow's published step, near Horovod's 68%


def test_lesson_17_takes_a_measured_step_time():
    out = run_python([os.path.join("lessons", "17_how_ddp_scales.py"), "--world-size", "1", "--step-ms", "20"],
                     timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "--step-ms 20" in out.stdout


def test_pictures_are_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from minddp_lab.simulate.report import draw_scaling, draw_timeline, sweep

    profile = profile_from_trace(synthetic_trace())
    rows = sweep(profile, LINK, [2, 8], [1, 25])
    draw_scaling(rows, str(tmp_path / "s.png"))
    draw_timeline(rows[-1].step, str(tmp_path / "t.png"))
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "t.png").stat().st_size > 0
