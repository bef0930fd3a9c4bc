"""The simulator's ZeRO: the paper's memory per rank, reduce-scatter and all-gather in the alpha-beta model,
stage 2's reduce-scatters overlapped with backward, stage 3 unit by unit (prefetch on and off, shared
cores, its working set), and ``python -m minddp_lab.simulate zero``.

Hand-computed values: the ZeRO paper's (Rajbhandari et al. 2020, section 3.1) for 7.5 B parameters on
64 ranks, and replays on a link of 1 ms per ring step and 1 GB/s. No process group.
"""

import contextlib
import io
import math
import os
import re
import subprocess
import sys

import pytest

from minddp_lab.network import (
    PRESETS,
    Hierarchy,
    Link,
    all_gather_time,
    allreduce_time,
    bytes_sent_per_rank,
    get_network,
    reduce_scatter_time,
)
from minddp_lab.simulate import ComputeProfile, DDPPolicy, Gradient
from minddp_lab.simulate.stage3 import Stage3Policy, Unit, simulate_stage3, working_set_bytes
from minddp_lab.simulate.zero import MODELS, memory_per_rank, predict, units_for, zero_step
from minddp_lab.simulate.zero_report import main as zero_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1_000_000
LINK = Link("hand", alpha_s=1e-3, bandwidth_Bps=1e9)  # 1 ms per ring step, 1 GB/s
NO_FIRST_CAP = DDPPolicy(bucket_cap_mb=1, first_bucket_cap_mb=1)  # 1 MiB: each 1 MB gradient its own bucket


# ----------------------------------------------------------------------------- memory, the paper's formula

def test_paper_example_7_5b_on_64_ranks():
    # Section 3.1: 16 x 7.5e9 = 120 GB; 4 x 7.5e9 + 12 x 7.5e9 / 64 = 31.4 GB; 2 x 7.5e9 + 14 x 7.5e9 / 64 = 16.6 GB.
    psi = MODELS["7.5b"].params
    assert memory_per_rank("ddp", psi, 64) == pytest.approx(120e9)
    assert memory_per_rank("stage1", psi, 64) == pytest.approx(31.40625e9)
    assert memory_per_rank("stage2", psi, 64) == pytest.approx(16.640625e9)


@pytest.mark.parametrize("n", [1, 8, 64, 1024])
def test_ddp_keeps_16_bytes_per_parameter_whatever_the_world_size(n):
    assert memory_per_rank("ddp", 7.5e9, n) == pytest.approx(120e9)


def test_one_rank_shards_nothing_and_many_ranks_approach_the_replicated_part():
    for setup in ("stage1", "stage2"):
        assert memory_per_rank(setup, 1e9, 1) == memory_per_rank("ddp", 1e9, 1)
    assert memory_per_rank("stage1", 1e9, 10**9) == pytest.approx(4e9, rel=1e-6)  # fp16 weights + gradients
    assert memory_per_rank("stage2", 1e9, 10**9) == pytest.approx(2e9, rel=1e-6)  # fp16 weights only


def test_fp32_variant_matches_the_package_measurement_table():
    # docs/zero_memory.txt, "paper" column: psi = 950,208, AdamW in fp32, N = 4: 14.50, 9.06, 6.34 MiB.
    psi, mib = 950_208, 2**20
    assert memory_per_rank("ddp", psi, 4, "fp32") / mib == pytest.approx(14.50, abs=0.005)
    assert memory_per_rank("stage1", psi, 4, "fp32") / mib == pytest.approx(9.06, abs=0.005)
    assert memory_per_rank("stage2", psi, 4, "fp32") / mib == pytest.approx(6.34, abs=0.005)


def test_unknown_setup_and_precision_are_named():
    with pytest.raises(ValueError, match="stage4"):
        memory_per_rank("stage4", 1e9, 8)
    with pytest.raises(ValueError, match="bf16"):
        memory_per_rank("ddp", 1e9, 8, "bf16")


# ----------------------------------------------------------------------------- the collectives

def test_reduce_scatter_and_all_gather_by_hand():
    # 4 ranks, 4 MB: 3 steps of 1 ms + 3 steps of 1 MB at 1 GB/s = 6 ms each.
    assert reduce_scatter_time(4 * MB, 4, LINK) == pytest.approx(6e-3)
    assert all_gather_time(4 * MB, 4, LINK) == pytest.approx(6e-3)
    assert reduce_scatter_time(4 * MB, 1, LINK) == 0.0


@pytest.mark.parametrize("network", [LINK, PRESETS["ib400"], PRESETS["eth25"], get_network("dgx-h100"),
                                     Hierarchy("odd", LINK, PRESETS["eth25"], 3)])
@pytest.mark.parametrize("n", [2, 3, 8, 64, 1000, 1024])
@pytest.mark.parametrize("nbytes", [1, 4 * MB, 3e9])
def test_reduce_scatter_plus_all_gather_is_the_ring_all_reduce(network, n, nbytes):
    both = reduce_scatter_time(nbytes, n, network) + all_gather_time(nbytes, n, network)
    assert both == pytest.approx(allreduce_time(nbytes, n, network, "ring"), rel=1e-12)
    sent = bytes_sent_per_rank("reduce_scatter", nbytes, n) + bytes_sent_per_rank("all_gather", nbytes, n)
    assert sent == pytest.approx(bytes_sent_per_rank("all_reduce", nbytes, n), rel=1e-12)


def test_a_bucket_collective_other_than_a_reduction_is_refused():
    with pytest.raises(ValueError, match="all_gather"):
        DDPPolicy(collective="all_gather")


# ----------------------------------------------------------------------------- the step

def _profile(optimizer_ms=4.0):
    # Gradients c then a, 1 MB each, ready at 1 and 10 ms of backward; forward 2 ms.
    return ComputeProfile(2.0, [Gradient("c", 1.0, MB), Gradient("a", 10.0, MB)], optimizer_ms)


def test_ddp_step_by_hand():
    s = zero_step(_profile(), LINK, 2, "ddp", NO_FIRST_CAP)
    # all-reduce 2 x 1 ms + 1 MB / 1 GB/s = 3 ms: c 1..4, a 10..13; forward 2 + 13 + optimizer 4
    assert [t for b in s.replay.buckets for t in (b.start_ms, b.end_ms)] == pytest.approx([1, 4, 10, 13])
    assert (s.gather_ms, s.step_ms) == pytest.approx((0.0, 19.0))
    assert s.wire_bytes == pytest.approx(2 * MB)  # 2 (N-1)/N x 2 MB


def test_stage2_reduce_scatters_each_bucket_under_backward_as_ddp_all_reduces_it():
    ddp = zero_step(_profile(), LINK, 2, "ddp", NO_FIRST_CAP)
    s2 = zero_step(_profile(), LINK, 2, "stage2", NO_FIRST_CAP)
    # The same buckets leave at the same moments (when ready, during backward) ...
    assert [b.start_ms for b in s2.replay.buckets] == [b.start_ms for b in ddp.replay.buckets] == [1.0, 10.0]
    assert s2.replay.buckets[0].end_ms < s2.replay.backward_end_ms  # the first one hides under backward
    # ... each a reduce-scatter: 1 ms + 0.5 MB / 1 GB/s = 1.5 ms, half the all-reduce.
    assert [t for b in s2.replay.buckets for t in (b.start_ms, b.end_ms)] == pytest.approx([1, 2.5, 10, 11.5])
    # after backward: optimizer on 1/2 of the state (2 ms), then two all-gathers of 1.5 ms
    assert s2.gather_ms == pytest.approx(3.0)
    assert s2.step_ms == pytest.approx(2 + 11.5 + 2 + 3)
    assert s2.wire_bytes == pytest.approx(ddp.wire_bytes)  # reduce-scatter + all-gather = all-reduce


def test_stage1_all_reduces_then_all_gathers_three_halves_of_ddp_traffic():
    ddp = zero_step(_profile(), LINK, 4, "ddp", NO_FIRST_CAP)
    s1 = zero_step(_profile(), LINK, 4, "stage1", NO_FIRST_CAP)
    assert [(b.start_ms, b.end_ms) for b in s1.replay.buckets] == [(b.start_ms, b.end_ms) for b in ddp.replay.buckets]
    # 4 ranks: all-reduce 6 x 1 ms + 1.5 MB / 1 GB/s = 7.5 ms: a ends at 17.5; the optimizer steps 1/4: 1 ms
    assert s1.replay.step_ms == pytest.approx(2 + 17.5 + 1)
    # 4 ranks: all-gather of 1 MB = 3 x 1 ms + 0.75 ms, twice; optimizer 4 / 4 ms instead of 4
    assert s1.gather_ms == pytest.approx(2 * 3.75)
    assert s1.step_ms == pytest.approx(ddp.step_ms - 4 + 1 + 7.5)
    assert s1.wire_bytes == pytest.approx(1.5 * ddp.wire_bytes)


def test_predicted_wire_bytes_of_the_7_5b_model_at_1024_ranks():
    # fp16 gradients: 2 psi = 15 GB per all-reduce buffer; a ring sends 2 (N-1)/N of it.
    model, net = MODELS["7.5b"], get_network("ib400")
    expected = 2 * 1023 / 1024 * 15e9
    memory, ddp = predict(model, net, 1024, "ddp")
    assert memory == pytest.approx(120e9)
    assert ddp.wire_bytes == pytest.approx(expected, rel=1e-6)
    assert predict(model, net, 1024, "stage2")[1].wire_bytes == pytest.approx(expected, rel=1e-6)
    assert predict(model, net, 1024, "stage1")[1].wire_bytes == pytest.approx(1.5 * expected, rel=1e-6)


# ----------------------------------------------------------------------------- stage 3, unit by unit

# Two units of 1 MB parameters and 1 MB gradients; forward 2 ms, backward 4 ms each. On LINK with 2 ranks an
# all-gather or a reduce-scatter of 1 MB is 1 ms + 0.5 MB / 1 GB/s = 1.5 ms.
UNITS = [Unit("a", MB, MB, 2.0, 4.0), Unit("b", MB, MB, 2.0, 4.0)]


def _timeline(step):
    return [(c.kind[0:2], c.unit, c.start_ms, c.end_ms) for c in step.collectives]


def test_stage3_memory_is_everything_over_n_the_papers_1_9_gb_for_7_5b_on_64_ranks():
    assert memory_per_rank("stage3", 7.5e9, 64) == pytest.approx(1.875e9)  # 16 x 7.5e9 / 64, section 3.1
    assert memory_per_rank("stage3", 950_208, 4, "fp32") == pytest.approx(16 * 950_208 / 4)
    # predict adds the working set: 2 units (prefetch) of 7.5e9 / 72 parameters, 2 + 2 bytes each
    memory, _ = predict(MODELS["7.5b"], LINK, 64, "stage3")
    assert memory == pytest.approx(1.875e9 + 2 * 4 * math.ceil(7.5e9 / 72))


def test_working_set_is_two_units_with_prefetch_one_without_all_without_resharding():
    assert working_set_bytes(UNITS) == 4 * MB
    assert working_set_bytes(UNITS, Stage3Policy(prefetch=False)) == 2 * MB
    assert working_set_bytes(UNITS, Stage3Policy(reshard_after_forward=False)) == 3 * MB  # all params + one grad


def test_stage3_without_prefetch_by_hand_every_gather_waits_and_queues_behind_the_reduce_scatter():
    s = simulate_stage3(UNITS, LINK, 2, optimizer_ms=4.0, policy=Stage3Policy(prefetch=False))
    assert _timeline(s) == [
        ("al", "a", 0, 1.5), ("al", "b", 3.5, 5.0),  # forward: gather a, compute a 1.5..3.5, gather b, compute b
        ("al", "b", 7, 8.5), ("re", "b", 12.5, 14), ("al", "a", 14, 15.5), ("re", "a", 19.5, 21)]
    assert s.forward_end_ms == pytest.approx(7.0)
    assert s.step_ms == pytest.approx(21 + 2)  # optimizer on half the state
    assert s.waiting_ms == pytest.approx(23 - 12 - 2)


def test_stage3_with_prefetch_by_hand_the_next_gather_runs_while_this_unit_computes():
    s = simulate_stage3(UNITS, LINK, 2, optimizer_ms=4.0)
    assert _timeline(s) == [
        ("al", "a", 0, 1.5), ("al", "b", 1.5, 3.0),  # b fetched while a computes 1.5..3.5
        ("al", "b", 5.5, 7), ("al", "a", 7, 8.5),  # in backward, a's gather goes ahead of b's reduce-scatter
        ("re", "b", 11, 12.5), ("re", "a", 15, 16.5)]
    assert (s.forward_end_ms, s.backward_end_ms, s.step_ms) == pytest.approx((5.5, 15, 16.5 + 2))
    assert s.step_ms < simulate_stage3(UNITS, LINK, 2, 4.0, Stage3Policy(prefetch=False)).step_ms


def test_stage3_on_shared_cores_compute_stands_still_while_the_wire_runs():
    # One core for both: whatever the order, the step is all compute plus all communication.
    s = simulate_stage3(UNITS, LINK, 2, policy=Stage3Policy(overlap=False))
    assert s.step_ms == pytest.approx(12 + 6 * 1.5)
    assert s.forward_end_ms == pytest.approx(7.0)  # a's compute paused 1.5..3 by b's prefetch


def test_stage3_keeping_the_last_unit_skips_its_gather_in_backward():
    # b ran last in forward, so its backward comes first: kept whole, a is prefetched at once.
    s = simulate_stage3(UNITS, LINK, 2, optimizer_ms=4.0, policy=Stage3Policy(keep_last=True))
    assert _timeline(s) == [
        ("al", "a", 0, 1.5), ("al", "b", 1.5, 3.0),
        ("al", "a", 5.5, 7), ("re", "b", 9.5, 11), ("re", "a", 13.5, 15)]
    assert s.step_ms == pytest.approx(15 + 2)
    assert s.step_ms < simulate_stage3(UNITS, LINK, 2, 4.0).step_ms


def test_stage3_keeping_the_root_skips_its_gather_at_the_end_of_backward():
    # a, the first unit of the forward, is the root: whole through the step, so backward gathers b alone
    # (kept too with keep_last: no gather at all in backward, only the two reduce-scatters).
    s = simulate_stage3(UNITS, LINK, 2, optimizer_ms=4.0, policy=Stage3Policy(keep_root=True))
    assert _timeline(s) == [
        ("al", "a", 0, 1.5), ("al", "b", 1.5, 3.0),
        ("al", "b", 5.5, 7), ("re", "b", 11, 12.5), ("re", "a", 15, 16.5)]
    both = simulate_stage3(UNITS, LINK, 2, optimizer_ms=4.0, policy=Stage3Policy(keep_root=True, keep_last=True))
    assert [c.kind for c in both.collectives if c.phase == "backward"] == ["reduce_scatter"] * 2
    assert both.step_ms == pytest.approx(5.5 + 8 + 1.5 + 2)  # backward computes 5.5..13.5, then a's scatter 13.5..15


def test_stage3_sends_three_halves_of_ddps_bytes_and_two_without_resharding():
    n = 4
    ddp = zero_step(ComputeProfile(0, [Gradient("a", 1, MB), Gradient("b", 2, MB)], 0), LINK, n, "ddp", NO_FIRST_CAP)
    s3 = simulate_stage3(UNITS, LINK, n)
    assert [c.kind for c in s3.collectives].count("all_gather") == 4
    assert s3.wire_bytes == pytest.approx(1.5 * ddp.wire_bytes)  # 3 x (N-1)/N x 2 MB against 2 x (N-1)/N x 2 MB
    kept = simulate_stage3(UNITS, LINK, n, policy=Stage3Policy(reshard_after_forward=False))
    assert kept.wire_bytes == pytest.approx(ddp.wire_bytes)
    assert simulate_stage3(UNITS, LINK, 1, 4.0).step_ms == pytest.approx(16.0)  # one rank: compute alone


def test_stage3_with_buckets_is_refused_and_bad_input_named():
    with pytest.raises(ValueError, match="simulate_stage3"):
        zero_step(_profile(), LINK, 2, "stage3")
    with pytest.raises(ValueError, match="world_size"):
        simulate_stage3(UNITS, LINK, 0)
    with pytest.raises(ValueError, match="unit"):
        simulate_stage3([], LINK, 2)


def test_predicted_stage3_of_the_7_5b_model_sends_1_5x_ddp_and_prefetch_helps():
    model, net = MODELS["7.5b"], get_network("ib400")
    ddp = predict(model, net, 1024, "ddp")[1]
    units = units_for(model)
    assert len(units) == 72 and sum(u.param_bytes for u in units) >= 2 * model.params
    on = predict(model, net, 1024, "stage3")[1]
    off = predict(model, net, 1024, "stage3", stage3=Stage3Policy(prefetch=False))[1]
    assert on.wire_bytes == pytest.approx(1.5 * ddp.wire_bytes, rel=1e-4)  # layers round up to whole parameters
    assert on.step_ms < off.step_ms


# ----------------------------------------------------------------------------- the command

def _run_main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = zero_main(argv)
    return code, out.getvalue()


def _table(text):
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"[\d,]+", cells[0]):
            rows[int(cells[0].replace(",", ""))] = [float(c.replace(",", "")) for c in cells[1:]]
    return rows


def test_command_shows_120_gb_for_ddp_at_every_world_size_and_the_paper_figures_at_64():
    code, text = _run_main(["--model", "7.5b", "--world", "8,64,1024"])
    assert code == 0
    rows = _table(text)
    assert sorted(rows) == [8, 64, 1024], text
    assert all(r[0] == 120.0 for r in rows.values()), text  # DDP GB/rank
    assert (rows[64][3], rows[64][6]) == (31.4, 16.6), text  # stage 1, stage 2 GB/rank
    assert rows[64][9] == pytest.approx(1.875 + 0.83, abs=0.051), text  # stage 3: 16 psi / N + its working set
    assert rows[1024][11] == pytest.approx(1.5 * rows[1024][2], rel=1e-3), text  # wire: 3 psi against 2 psi


def test_command_through_python_dash_m_and_its_errors():
    env = dict(os.environ, PYTHONPATH=ROOT)
    ok = subprocess.run([sys.executable, "-m", "minddp_lab.simulate", "zero", "--model", "gpt2-xl", "--world", "8"],
                        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert _table(ok.stdout)[8][0] == 24.0  # 16 x 1.5 B
    bad = subprocess.run([sys.executable, "-m", "minddp_lab.simulate", "zero", "--model", "gpt5"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "unknown model 'gpt5'" in bad.stderr


def test_docs_simulate_zero_is_the_default_commands_output():
    with open(os.path.join(ROOT, "docs", "simulate_zero.txt")) as f:
        first, saved = f.readline(), f.read()
    assert first.strip() == "$ python -m minddp_lab.simulate zero"
    assert saved == _run_main([])[1], "docs/simulate_zero.txt is stale: regenerate it with the command on its first line"
