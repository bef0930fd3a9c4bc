"""minddp_lab.auto.plan_buckets: the choice follows the alpha-beta model, agrees on every rank, and changes no result.

Two layers. :func:`choose_plan` is pure: a made-up step (when each gradient
is ready) and a made-up link go in, a plan comes out, checked against what
the model says by hand. Then a planned MiniDDP, on 2 Gloo ranks whose
all-reduces go through a :class:`~minddp_lab.simulated_link.SimulatedLink`: it
measures its own steps, probes the (simulated) link, and must pick few
buckets on a slow high-latency link, several on a fast one with compute to
hide behind, the same on both ranks, with parameters equal to torch's DDP.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from minddp import MiniDDP
from minddp_lab.auto.costs import contention_us_per_MB, fixed_cost_us
from minddp_lab.auto import plan_buckets, planner_of
from minddp_lab.auto.policy import MEASURED_BACKWARDS, SETTLING_BACKWARDS, AutoBuckets
from minddp_lab.auto.planner import (CANDIDATE_CAPS_MB, LEAVE_DEFAULT_MARGIN, choose_plan, leave_default_margin,
                                       plan_policy, replay)
from minddp_lab.network import Link
from minddp_lab.simulate import ComputeProfile, Gradient, simulate_step
from minddp_lab.simulate.overheads import Overheads
from minddp_lab.simulated_link import SimulatedLink, simulated_allreduce_hook
from minddp.zero import ZeroRedundancyOptimizer

MB = 1024 * 1024


def _step(n_gradients=8, nbytes=MB, every_ms=10.0) -> ComputeProfile:
    """Backward produces one ``nbytes`` gradient every ``every_ms``."""
    grads = [Gradient(f"g{i}", every_ms * (i + 1), nbytes) for i in range(n_gradients)]
    return ComputeProfile(forward_ms=20.0, gradients=grads)


# ------------------------------------------------------------- choose_plan
def test_a_slow_high_latency_link_gets_one_bucket():
    # 50 ms per message, 2 ring steps at p=2: each extra bucket costs 100 ms,
    # far more than the 80 ms of backward it could hide behind.
    link = Link("slow", alpha_s=50e-3, bandwidth_Bps=1e9)
    choice = choose_plan(_step(), link, world_size=2)
    assert choice.buckets == 1, f"expected one bucket on a 50 ms-latency link, got {choice}"
    # By hand: backward ends at 80 ms, then 100 ms latency + 8 MiB at 1 GB/s.
    assert choice.predicted_ms == pytest.approx(20 + 80 + 100 + 8 * MB / 1e9 * 1e3)
    # The default: a 1 MiB first bucket (ready at 10 ms), then the other 7 MiB
    # (ready at 80 ms, but the wire is busy until 110 ms): two latencies.
    assert choice.default_buckets == 2
    assert choice.default_ms == pytest.approx(20 + 10 + 2 * 100 + 8 * MB / 1e9 * 1e3)


FAST = Link("fast", alpha_s=10e-6, bandwidth_Bps=100e6)  # 1 MiB takes ~10 ms: as long as a gradient's backward
ONE_BUCKET_MS = 20 + 80 + 2 * 10e-3 + 8 * MB / 100e6 * 1e3  # forward, backward, then all of it on the wire


def test_a_fast_low_latency_link_with_compute_to_hide_behind_keeps_overlap():
    # 10 us latency; 1 MiB takes ~10 ms at 100 MB/s, as long as the backward
    # takes to produce the next gradient: each bucket hides behind the next.
    choice = choose_plan(_step(), FAST, world_size=2)
    assert choice.buckets >= 4, f"expected several buckets to overlap with backward, got {choice}"
    assert choice.predicted_ms < ONE_BUCKET_MS - 40, "overlap must hide most of the all-reduce"


def _buckets(plan, link=FAST, costs=Overheads()) -> int:
    return len(simulate_step(_step(), link, 2, plan_policy(plan, costs)).buckets)


def test_the_model_proposes_the_default_its_best_plan_on_either_side_and_one_halfway_for_the_clock_to_decide():
    # Where the model cannot tell (a step it explains only to within 30%), both sides are worth timing: the
    # default (2 buckets here), the best with fewer (1), the best with more (8), and the plan halfway between
    # the default and that best on a log scale (4), in case the model's best has too many buckets.
    unsure = choose_plan(_step(), FAST, world_size=2, margin=0.30)
    default = unsure.contenders[0]
    assert default == (25.0, 1.0) and _buckets(default) == 2
    assert [_buckets(plan) for plan in unsure.contenders[1:]] == [1, unsure.buckets, 4], unsure.contenders
    assert unsure.buckets == 8 and unsure.contenders[2] == (unsure.cap_mb, unsure.first_cap_mb), "the model's pick"
    # Where the model knows the step to 1%, one bucket is predicted far slower than the default: not timed.
    sure = choose_plan(_step(), FAST, world_size=2, margin=0.01)
    assert [_buckets(plan) for plan in sure.contenders] == [2, sure.buckets, 4]
    # On a 50 ms link every other plan is predicted slower by far more than 30%, but one bucket saves a latency;
    # with no plan of more buckets worth timing, none halfway either.
    slow = choose_plan(_step(), Link("slow", alpha_s=50e-3, bandwidth_Bps=1e9), world_size=2, margin=0.30)
    assert [_buckets(plan, slow.link) for plan in slow.contenders] == [2, 1], slow.contenders


def test_no_plan_halfway_when_the_best_with_more_buckets_is_next_to_the_default():
    # Three 1 MiB gradients: the default has 2 buckets (1 MiB, then 2), the most any plan builds is 3, and
    # halfway between 2 and 3 is one of them, already timed. With four, halfway between 2 and 4 is 3.
    three, four = _step(n_gradients=3), _step(n_gradients=4)
    for step, expected in ((three, [2, 1, 3]), (four, [2, 1, 4, 3])):
        choice = choose_plan(step, FAST, world_size=2, margin=0.30)
        timed = [len(simulate_step(step, FAST, 2, plan_policy(plan, choice.costs)).buckets)
                 for plan in choice.contenders]
        assert timed == expected, choice.contenders


def test_each_bucket_pays_minddps_own_cost_so_a_large_one_means_fewer_buckets():
    # The same link and step, but every bucket costs backward 6 ms of MiniDDP's own work (fill and launch):
    # each extra bucket now adds more than the part of the transfer it could hide.
    free = choose_plan(_step(), FAST, world_size=2)
    costly = choose_plan(_step(), FAST, world_size=2, costs=Overheads(per_bucket_us=6000))
    assert costly.buckets < free.buckets, f"{costly.buckets} buckets at 6 ms each, {free.buckets} when free"
    assert costly.costs.per_bucket_us == 6000, "the choice keeps the costs it was made with"
    # By hand, one bucket: backward's 80 ms, its fill and launch (6 ms), then the whole transfer.
    one = choose_plan(_step(), Link("slow", alpha_s=50e-3, bandwidth_Bps=1e9), 2, Overheads(per_bucket_us=6000))
    assert one.buckets == 1 and one.predicted_ms == pytest.approx(20 + 80 + 6 + 100 + 8 * MB / 1e9 * 1e3)


def _all_of_the_cpu(link: Link) -> float:
    """us per MB sent of an all-reduce that keeps the CPU busy all its time (1 MB takes 1e6/bandwidth s)."""
    return 1e6 / link.bandwidth_Bps * 1e6


def test_an_all_reduce_that_takes_all_of_the_cpu_hides_nothing_so_no_plan_beats_the_default():
    # Communication that takes the cores backward needs for all its time (Gloo over loopback, no core to
    # spare) stops backward while it runs: no plan hides anything, even on a fast link. One bucket and the
    # default both come to forward + backward + the whole transfer, and on a tie the default stays.
    choice = choose_plan(_step(), FAST, world_size=2, costs=Overheads(contention_us_per_MB=_all_of_the_cpu(FAST)))
    assert (choice.cap_mb, choice.first_cap_mb, choice.buckets) == (25.0, 1.0, choice.default_buckets), choice
    assert choice.predicted_ms == choice.default_ms == pytest.approx(ONE_BUCKET_MS, rel=1e-3)


def test_a_plan_predicted_only_a_little_faster_than_the_default_does_not_replace_it():
    # Busy 95% of an all-reduce: five buckets are predicted 1.7% faster than the default, less than the
    # model's own error on a shared machine; busy 90%: 3.4% faster, enough to leave the default.
    nearly = choose_plan(_step(), FAST, 2, costs=Overheads(contention_us_per_MB=0.95 * _all_of_the_cpu(FAST)))
    clearly = choose_plan(_step(), FAST, 2, costs=Overheads(contention_us_per_MB=0.9 * _all_of_the_cpu(FAST)))
    assert (nearly.cap_mb, nearly.first_cap_mb) == (25.0, 1.0) and nearly.predicted_ms == nearly.default_ms, nearly
    assert nearly.passed_over[0] == 5 and "kept: the fastest plan, 5 bucket(s)" in nearly.describe(), nearly
    assert clearly.passed_over is None
    assert clearly.buckets == 5 and clearly.predicted_ms < (1 - LEAVE_DEFAULT_MARGIN) * clearly.default_ms, clearly


def test_the_margin_is_the_models_own_error_on_the_defaults_measured_step_one_percent_at_least():
    # A predicted gain smaller than what the model got wrong about the default's own step is within its
    # error; where the model explains that step, a small gain is real (100 Mbit/s: 1.6% predicted, 2.5% measured).
    assert leave_default_margin(measured_ms=100.0, modelled_ms=95.0) == pytest.approx(0.05)
    assert leave_default_margin(measured_ms=100.0, modelled_ms=108.0) == pytest.approx(0.08), "over or under"
    assert leave_default_margin(measured_ms=100.0, modelled_ms=99.8) == 0.01
    assert leave_default_margin(measured_ms=None, modelled_ms=50.0) == LEAVE_DEFAULT_MARGIN, "nothing measured"


def test_a_small_predicted_gain_replaces_the_default_only_under_a_small_margin():
    nearly_costs = Overheads(contention_us_per_MB=0.95 * _all_of_the_cpu(FAST))  # five buckets 1.7% faster
    trusted = choose_plan(_step(), FAST, 2, costs=nearly_costs, margin=0.01)
    assert trusted.buckets == 5 and trusted.passed_over is None and trusted.margin == 0.01, trusted
    clearly_costs = Overheads(contention_us_per_MB=0.9 * _all_of_the_cpu(FAST))  # 3.4% faster
    doubted = choose_plan(_step(), FAST, 2, costs=clearly_costs, margin=0.05)
    assert (doubted.cap_mb, doubted.first_cap_mb) == (25.0, 1.0) and doubted.passed_over[0] == 5, doubted
    assert "is not 5% faster" in doubted.describe()


def test_an_all_reduce_that_takes_part_of_the_cpu_still_hides_the_rest():
    # Busy 30% of its time: the old yes-or-no rule (under 15%: overlaps) kept one bucket here. Charged
    # continuously, the other 70% still runs beside backward: several buckets, a step between the two ends.
    partly = choose_plan(_step(), FAST, world_size=2,
                         costs=Overheads(contention_us_per_MB=0.3 * _all_of_the_cpu(FAST)))
    free = choose_plan(_step(), FAST, world_size=2)
    assert partly.buckets > 1, partly
    assert free.predicted_ms < partly.predicted_ms < ONE_BUCKET_MS, (free, partly)


def test_contention_is_the_probes_cpu_per_mb_sent_where_backward_has_no_other_core(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("os.cpu_count", lambda: 2)  # 2 ranks of 1 thread each: no core for Gloo's thread
    torch.set_num_threads(1)
    # 2 MB all-reduced by 2 ranks: each sends 2 (p-1)/p x 2 MB = 2 MB; 10 ms of CPU for it: 5000 us per MB.
    assert contention_us_per_MB(cpu, 2, cpu_seconds=0.010, nbytes=2e6) == pytest.approx(5000)
    assert contention_us_per_MB(gpu, 2, cpu_seconds=0.010, nbytes=2e6) == 0, "a GPU's streams do the work"
    monkeypatch.setattr("os.cpu_count", lambda: 4)  # one core each for compute, one for Gloo
    assert contention_us_per_MB(cpu, 2, cpu_seconds=0.010, nbytes=2e6) == 0


def test_minddps_own_cost_per_bucket_is_the_fill_at_zero_bytes_plus_the_launch():
    # Fills that take 80 us plus 1 ns per byte, at two bucket sizes, a few times each; launches of 30 us.
    fills = [(n, 80e-6 + n * 1e-9 + noise) for n in (MB, 3 * MB) for noise in (0.0, 2e-6, 50e-6)]
    assert fixed_cost_us(fills, [30e-6, 31e-6, 29e-6]) == pytest.approx(110, abs=3)
    # One bucket size only: no line to draw, the fastest fill counts whole (copy included).
    assert fixed_cost_us([(MB, 500e-6), (MB, 400e-6)], [30e-6]) == pytest.approx(430)
    # Noise that tilts the line below zero bytes: nothing, not a negative cost.
    assert fixed_cost_us([(MB, 900e-6), (3 * MB, 3000e-6)], []) == 0
    assert fixed_cost_us([], []) == 0, "no bucket filled: nothing measured, nothing charged"


def _planner_of(nbytes: list[int]) -> AutoBuckets:
    """An AutoBuckets on a stand-in reducer with parameters of these sizes (float32), for its pure parts."""
    params = [torch.zeros(n // 4) for n in nbytes]
    reducer = SimpleNamespace(options=SimpleNamespace(reduce_dtype=None), params=params,
                              names=[f"g{i}" for i in range(len(params))], add_observer=lambda observer: None,
                              observers=())
    return AutoBuckets(reducer)


def _instantly(buffer: torch.Tensor) -> torch.futures.Future:
    """A link that costs nothing: the probe's all-reduce is done as soon as it is sent."""
    done = torch.futures.Future()
    done.set_result([buffer])
    return done


def test_the_defaults_measured_step_sets_what_every_plan_is_charged_beyond_the_model():
    # Backwards of 30 ms (two gradients, ready at 0 and 30 ms), each ending 25 ms after its last hook (waiting
    # for its buckets, writing .grad), the next starting 20 ms later: a measured step of 55 + 20 = 75 ms with
    # the default's buckets. On a link that costs nothing the model sees 20 + 30 = 50 ms (and MiniDDP's own
    # work, here none): 25 ms per step it does not explain, charged to every plan, so the default is
    # predicted at its measured 75 ms.
    planner = _planner_of([MB, MB])
    start = 0.0
    for _ in range(MEASURED_BACKWARDS + 1):
        arrivals = [(1, start), (0, start + 0.030)]
        assert planner.backward_done(arrivals, start + 0.055) == (start > 0.2)
        start += 0.075
    assert planner.measured_step_ms() == pytest.approx(75)
    assert planner.profile().backward_ms == pytest.approx(30) and planner.profile().forward_ms == pytest.approx(20)
    choice = planner.decide(_instantly, 2, torch.device("cpu"), torch.float32, is_rank0=True)
    assert choice.costs.per_step_ms == pytest.approx(75 - 50, abs=0.5)
    assert choice.default_ms == pytest.approx(75, abs=0.5)
    assert choice.margin == pytest.approx(25 / 75, abs=0.01), "a model this far off trusts no small gain"
    assert replay(planner.profile(), choice.link, 2, (choice.cap_mb, choice.first_cap_mb), choice.costs) == \
        pytest.approx(choice.predicted_ms), "the prediction is the replay with every cost it charged"


def test_a_step_faster_than_the_model_charges_nothing_negative():
    planner = _planner_of([MB, MB])
    for k in range(MEASURED_BACKWARDS + 1):  # steps that end at their last hook and start at once again
        planner.backward_done([(1, k * 0.03), (0, k * 0.03 + 0.03)], k * 0.03 + 0.03)
    assert planner.measured_step_ms() == pytest.approx(30)
    choice = planner.decide(_instantly, 2, torch.device("cpu"), torch.float32, is_rank0=True)
    assert choice.costs.per_step_ms == 0
    assert choice.margin == pytest.approx(0.01, abs=0.005), "the model explains these steps to within 1%"


def test_the_link_probe_never_holds_more_than_the_largest_candidate_bucket():
    # 3 gradients of 48 MiB: the probe's large all-reduce was a buffer of all 144 MiB, a third copy of the
    # gradients for a moment (a GPU's memory, on a large model); the largest bucket any plan builds is enough.
    planner = _planner_of([48 * MB] * 3)
    for k in range(MEASURED_BACKWARDS + 1):
        planner.backward_done([(2, k * 0.03), (1, k * 0.03 + 0.01), (0, k * 0.03 + 0.02)], k * 0.03 + 0.03)
    sent = []

    def communicate(buffer: torch.Tensor) -> torch.futures.Future:
        sent.append(buffer.nbytes)
        return _instantly(buffer)

    planner.decide(communicate, 2, torch.device("cpu"), torch.float32, is_rank0=True)
    assert max(sent) == max(CANDIDATE_CAPS_MB) * MB, sent


# -------------------------------------------------------- MiniDDP, 2 ranks
class Tower(nn.Module):
    """Four 512x512 layers: 1 MiB of gradient each, real compute to hide behind."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def _train_auto(rank, world_size, alpha_s, bandwidth_Bps, steps, bucket_view=False):
    torch.manual_seed(0)
    mini = MiniDDP(Tower(), gradient_as_bucket_view=bucket_view)
    mini.register_comm_hook(SimulatedLink(Link("sim", alpha_s, bandwidth_Bps)), simulated_allreduce_hook)
    assert plan_buckets(mini) is planner_of(mini) is not None
    torch.manual_seed(0)
    native = TorchDDP(Tower())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (mini, native)]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)
        for model, opt in zip((mini, native), optimizers):
            opt.zero_grad(set_to_none=not bucket_view)  # views: .grad kept, a slot of the buckets at each rebuild
            F.mse_loss(model(x), y).backward()
            opt.step()
        if step == 1:  # one bucket until the first backward showed the order; from the next forward, the default's
            default_buckets = len(mini.bucket_names)
    diff = max((p - q).abs().max().item() for p, q in zip(mini.parameters(), native.parameters()))
    planner = planner_of(mini)
    choice, replayed = planner.choice, None
    if choice is not None:  # rank 0 decided: the same model on what it measured must choose the same
        replayed = choose_plan(planner.profile(), choice.link, world_size, choice.costs, choice.cpu_share,
                               choice.margin)
    return {"buckets": mini.bucket_names, "default_buckets": default_buckets, "diff": diff,
            "choice": choice, "replayed": replayed, "profile": planner.profile() if choice else None}


STEPS = SETTLING_BACKWARDS + 2  # the first, the measured backwards, the trials, and two with the kept buckets


def _check_auto_end_to_end(results):
    """What holds whatever the measured times: every rank built the buckets of rank 0's choice, which
    is the fastest of the plans the model proposed for what rank 0 measured, timed in turn (the default
    unless one was more than 1% faster), and the parameters equal torch's DDP. Which plan the model
    prefers for a given link is checked without any clock by the choose_plan tests above, the verdict
    on timed steps by tests/lab/test_plan_trials.py: under load the measured steps move, and so may the best
    plan."""
    assert results[0]["buckets"] == results[1]["buckets"], "every rank must build rank 0's buckets"
    assert results[0]["default_buckets"] >= 2, "the test needs a model the default splits"
    choice = results[0]["choice"]
    assert choice is not None and results[1]["choice"] is None, "rank 0 decides, and only rank 0"
    assert len(results[0]["buckets"]) == choice.buckets, (
        f"the buckets built ({len(results[0]['buckets'])}) are not the plan chosen: {choice.describe()}")
    assert results[0]["replayed"].contenders == choice.contenders, "the model's proposals for what rank 0 measured"
    kept = (choice.cap_mb, choice.first_cap_mb)
    if len(choice.contenders) > 1:
        assert [t.plan for t in choice.trials] == list(choice.contenders), "every proposal was timed"
        best = min(choice.trials, key=lambda trial: trial.ratio)
        assert kept == (best.plan if best.ratio < 0.99 else choice.contenders[0]), choice.describe()
        assert {t.buckets for t in choice.trials} >= {choice.buckets}, "each trial counts the buckets it built"
    else:
        assert kept == choice.contenders[0], "nothing else proposed: the default stays"
    assert choice.predicted_ms == pytest.approx(replay(results[0]["profile"], choice.link, 2, kept, choice.costs)), \
        "the printed prediction is the model's for the plan kept"
    for r in results:  # bucketing changes the summation order only: float32 rounding
        assert r["diff"] < 1e-5, f"parameters differ from torch's DDP by {r['diff']}"
    return choice


def test_auto_on_a_slow_link_rebuilds_rank_0s_choice_on_every_rank_and_matches_torch(ranks):
    _check_auto_end_to_end(ranks(2).run(_train_auto, 20e-3, 1e9, STEPS, timeout_s=120))


def test_auto_on_a_fast_link_rebuilds_rank_0s_choice_on_every_rank_and_matches_torch(ranks):
    # 50 us latency, 4 MiB take ~100 ms at 40 MB/s: longer than the backward.
    choice = _check_auto_end_to_end(ranks(2).run(_train_auto, 50e-6, 40e6, STEPS, timeout_s=120))
    assert choice.costs.per_bucket_us > 0, "MiniDDP's own fill and launch of each bucket were measured"


def test_auto_with_bucket_views_moves_every_gradient_through_each_plan_it_times_and_matches_torch(ranks):
    # Each plan timed is a rebuild at a forward: every .grad, kept by zero_grad(set_to_none=False) as a slot
    # of the old buckets, moves into its slot of the new ones.
    choice = _check_auto_end_to_end(ranks(2).run(_train_auto, 50e-6, 40e6, STEPS, True, timeout_s=120))
    assert len(choice.trials) >= 2, f"the fast link proposes more buckets than the default: {choice.describe()}"


def _misuse(rank, world_size):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB"):
        MiniDDP(Tower(), bucket_cap_mb="fast")
    with pytest.raises(ValueError, match=r"minddp_lab\.auto\.plan_buckets"):  # the library has no planner
        MiniDDP(Tower(), bucket_cap_mb="auto")
    with pytest.raises(TypeError, match="MiniDDP"):
        plan_buckets(Tower())
    with pytest.raises(ValueError, match="bucket_cap_mb_list"):  # the planner chooses the caps
        plan_buckets(MiniDDP(Tower(), bucket_cap_mb_list=[1.0, 4.0]))
    auto = MiniDDP(Tower())
    plan_buckets(auto)
    with pytest.raises(ValueError, match="once"):
        plan_buckets(auto)
    with pytest.raises(ValueError, match="ZeRO stage 2"):  # it partitions by buckets that will change
        ZeroRedundancyOptimizer(auto.parameters(), torch.optim.SGD, ddp=auto, lr=0.1, shard_gradients=True)
    return True


def _alone(rank, world_size):
    import torch.distributed as dist

    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group, in one order
    ddp = MiniDDP(Tower(), process_group=groups[rank])  # a world of one: nothing to plan
    return plan_buckets(ddp) is None and planner_of(ddp) is None


def test_auto_misuse_is_named(ranks):
    assert ranks(2).run(_misuse) == [True, True]


def test_alone_there_is_nothing_to_plan(ranks):
    assert ranks(2).run(_alone) == [True, True]
