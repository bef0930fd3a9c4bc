"""The lessons' time claims rest on models and counts, never on the clock.

Lessons 06, 07, 16, 17 and 17b check what they claim about time with small pure
functions: 06 replays a backward in the link model's time and bounds its
saving for any timing of the hooks, 07 lets a bucket leave when its own last
gradient is ready and shows the U on a stated backward, 16 splits a bar
into waiting and travelling, 17 states for which compute speeds, networks
and algorithms each comparison goes which way, 17b which link gets fewer
buckets for any length of backward. Those functions are tested
here on hand-made inputs, without a process group, so that a busy machine
cannot move them. (The lessons themselves run in tests/course/test_lessons.py.)
"""

import importlib.util
import math
import random
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minddp_lab.simulate import ComputeProfile, DDPPolicy, Gradient
from minddp_lab.network import allreduce_time, get_link
from minddp_lab.simulated_link import Message
from minddp_lab.trace_view import BucketBar, StepView

LESSONS = Path(__file__).resolve().parents[2] / "lessons"


def lesson(stem: str):
    """Import lessons/<stem>.py as a module (its name starts with a digit)."""
    sys.path.insert(0, str(LESSONS))  # for its `from _common import ...`
    try:
        spec = importlib.util.spec_from_file_location(f"lesson_{stem}", LESSONS / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # a dataclass looks its module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(LESSONS))


def fake_backward(backward_s: float, launches: list[tuple[float, float]]):
    """An AsyncDDP's record of one backward: (launched at, modelled seconds) per hook, from forward's end at 0."""
    timeline = [[f"p{i}", t, None, Message(100, d, t)] for i, (t, d) in enumerate(launches)]
    return SimpleNamespace(forward_done=0.0, backward_done=backward_s, timeline=timeline)


def test_06_replays_the_backward_in_the_links_time():
    modelled = lesson("06_async_overlap").modelled
    # Backward 10 ms; two 4 ms messages launched at 1 and 2 ms: the wire ends at 5 and 9 ms, under backward.
    m = modelled(fake_backward(0.010, [(0.001, 0.004), (0.002, 0.004)]))
    assert m["backward"] == pytest.approx(10) and m["wire"] == pytest.approx(8)
    assert m["waiting"] == pytest.approx(18)  # waiting in each hook: backward, then every message in turn
    assert m["overlap"] == pytest.approx(10) and m["hidden"] == 2
    # A third message at 9 ms queues behind the second (free at 9) and ends at 13: after backward.
    m = modelled(fake_backward(0.010, [(0.001, 0.004), (0.002, 0.004), (0.009, 0.004)]))
    assert m["overlap"] == pytest.approx(13) and m["hidden"] == 2 and m["waiting"] == pytest.approx(22)


def test_06_the_drawing_and_the_count_are_of_one_replayed_backward():
    # The timeline the lesson draws is the replay its "N of 10 end during backward" counts.
    m = lesson("06_async_overlap").modelled(fake_backward(0.010, [(0.001, 0.004), (0.002, 0.004), (0.009, 0.004)]))
    assert [tuple(round(v, 9) for v in row[1:]) for row in m["rows"]] == [(1, 1, 5), (2, 5, 9), (9, 9, 13)]
    assert m["hidden"] == sum(done < m["backward"] for *_, done in m["rows"]) == 2


def test_06_a_hook_that_fires_as_backward_returns_keeps_its_mark_in_the_drawing(capsys):
    # The last hooks fire in the very column where backward returns: "|" must not hide their "^".
    draw = lesson("06_async_overlap").draw
    draw([("p0", 1.0, 1.0, 5.0), ("p1", 9.99, 10.0, 12.0), ("p2", 10.0, 10.0, 12.0)], 10.0, 12.0)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] in (["p0"], ["p1"], ["p2"])]
    assert len(rows) == 3 and all("^" in row for row in rows), rows
    assert "|" in rows[0], rows[0]  # where no hook fired there, the end of backward shows


class _TimedWrapper:
    """Stands for lesson 06's wrapper in ``time_alternately``: each step as long as the next of ``step_ms``."""

    def __init__(self, step_ms: list[float]):
        self.step_ms, self.backward_and_sync_ms, self.link, self.timeline = list(step_ms), [], None, []

    def zero_grad(self):
        pass

    def __call__(self, x):
        return x.sum() * torch.ones((), requires_grad=True)

    def finish_gradient_synchronization(self):
        ms = self.step_ms.pop(0)
        self.forward_done, self.backward_done, self.all_done = 0.0, ms / 2e3, ms / 1e3
        self.timeline = [["p0", 0.0, ms / 1e3, None]]
        self.backward_and_sync_ms.append(ms)


def test_06_without_a_link_the_drawn_backward_is_the_fastest_whose_time_is_printed(monkeypatch):
    module = lesson("06_async_overlap")
    monkeypatch.setattr(module.dist, "barrier", lambda: None)
    slow, fast = _TimedWrapper([30, 20, 25, 40, 50, 60]), _TimedWrapper([9, 8, 7, 12, 14, 16])
    (slow_ms, fast_ms), model, (slow_rows, fast_rows) = module.time_alternately([slow, fast], per_rank=2)
    assert model is None and (slow_ms, fast_ms) == (20, 7)
    assert slow_rows[2] == pytest.approx(20) and fast_rows[2] == pytest.approx(7)  # all done: the printed time
    assert fast_rows[1] == pytest.approx(3.5)  # its backward, not the last step's (8 ms)


def test_06_the_saving_is_bounded_whatever_the_hooks_timing():
    # A core taken away for 35 ms after the first hook: ten 4.4 ms messages, nine of them launched late.
    modelled = lesson("06_async_overlap").modelled
    paused = fake_backward(0.046, [(0.001, 0.0044)] + [(0.037 + 0.001 * i, 0.0044) for i in range(9)])
    m = modelled(paused)
    saved, most = m["waiting"] - m["overlap"], min(m["backward"], m["wire"])
    assert saved == pytest.approx(13.4) and most == pytest.approx(44)  # not over half of min(backward, wire)
    assert (m["hidden"], m["hidden_wire"]) == (3, pytest.approx(13.2))  # the first, and two right after the pause
    assert m["hidden_wire"] <= saved <= most  # what the lesson claims: it holds here too
    rng = random.Random(0)
    for _ in range(500):  # and for any other timing of the hooks
        backward = rng.uniform(0.001, 0.2)
        launches = sorted((rng.uniform(0, backward), rng.uniform(0.0001, 0.01)) for _ in range(rng.randint(1, 12)))
        m = modelled(fake_backward(backward, launches))
        saved = m["waiting"] - m["overlap"]
        assert m["hidden_wire"] - 1e-9 <= saved <= min(m["backward"], m["wire"]) + 1e-9, (launches, backward, m)


def test_06_the_clock_does_not_enter_the_model():
    # The same launches, however late the sums really arrived (a slow peer): the same replay.
    modelled = lesson("06_async_overlap").modelled
    early = fake_backward(0.010, [(0.001, 0.004)])
    late = fake_backward(0.010, [(0.001, 0.004)])
    late.timeline[0][2] = 0.500  # finished half a second later by the clock
    late.timeline[0][3].finished = 0.500
    assert modelled(early) == modelled(late)


def buckets_07(cap: float, registration_order: bool = False):
    """Lesson 07's BucketDDP, its buckets built as the lesson builds them, without a process group."""
    les, common = lesson("07_buckets"), lesson("_common")
    ddp = les.BucketDDP.__new__(les.BucketDDP)
    torch.nn.Module.__init__(ddp)
    ddp.bucket_cap_bytes, ddp.params = cap, list(common.make_model(seed=0, width=les.WIDTH, depth=les.DEPTH).parameters())
    ddp._build_buckets(ddp.params if registration_order else ddp.params[::-1])
    return ddp


def model_07(backward_ms: float, world_size: int, registration_order: bool = False) -> list[tuple[float, float]]:
    """Lesson 07's sweep in the model: (cap, step ms) on gradients ready evenly over ``backward_ms``."""
    les = lesson("07_buckets")
    wire_ms = lambda n: 1e3 * allreduce_time(n, world_size, get_link("laptop"))  # noqa: E731
    caps = [0, 300 * 1024, 600 * 1024, 1100 * 1024, 1600 * 1024, math.inf]
    rows = []
    for cap in caps:
        ddp = buckets_07(cap, registration_order)
        ready = les.stated_readiness(len(ddp.params), backward_ms)
        rows.append((cap, backward_ms / 2 + les.predicted_ms(les.bucket_readiness(ddp, ready), wire_ms)))
    return rows


def test_07_has_u_means_the_best_cap_strictly_in_between():
    has_u = lesson("07_buckets").has_u
    assert has_u([(0, 9.0), (1, 5.0), (math.inf, 7.0)])
    assert not has_u([(0, 5.0), (1, 6.0), (math.inf, 7.0)])  # the smallest cap is best
    assert not has_u([(0, 9.0), (1, 7.0), (math.inf, 7.0)])  # a tie with an end is no U
    assert not has_u([(0, 9.0), (1, 8.0), (math.inf, 7.0)])


@pytest.mark.parametrize("world_size", [2, 3])
def test_07_the_u_shows_on_the_stated_backward(world_size):
    les = lesson("07_buckets")
    rows = model_07(les.STATED_BACKWARD_MS, world_size)
    assert les.has_u(rows), rows
    assert les.stated_readiness(4, 40.0) == [40.0, 30.0, 20.0, 10.0]  # the last layer's gradients first


@pytest.mark.parametrize("backward_ms", [1.0, 40.0, 300.0])
def test_07_in_registration_order_no_backward_shows_a_u(backward_ms):
    rows = model_07(backward_ms, 2, registration_order=True)
    assert min(rows, key=lambda row: row[1])[0] == math.inf, rows  # one bucket: the fewest alphas


def test_07_a_much_faster_or_slower_machine_loses_the_u_which_is_why_it_is_not_checked_on_this_one():
    les = lesson("07_buckets")
    assert not les.has_u(model_07(300.0, 2))  # crawling: per-parameter all-reduces keep up
    assert not les.has_u(model_07(2.0, 2))  # 20x the stated speed: too little backward to hide under


def test_16_splits_a_bar_into_waiting_and_travelling():
    les = lesson("16_overlap_trace")
    view = StepView(0, 0, start_ms=0.0, end_ms=12.0, hooks=[("a", 0.0), ("b", 6.0)],
                    buckets=[BucketBar(0, 1.0, 5.0, 100), BucketBar(1, 2.0, 9.0, 100)])
    # One wire: bucket 1 launched at 2 ms waits for bucket 0 until 5 ms.
    assert les.on_the_wire(view, one_wire=True) == [1.0, 5.0]
    assert les.on_the_wire(view, one_wire=False) == [1.0, 2.0]
    hidden, total = les.hidden_ms(view, one_wire=True)
    # Before the last hook (6 ms): bucket 0 travels 1..5 (4 ms), bucket 1 travels 5..6 (1 ms).
    assert (hidden, total) == pytest.approx((5.0, 8.0))


def test_16_explains_a_bar_by_the_wire_the_peers_and_the_machine():
    les = lesson("16_overlap_trace")
    wire = lambda nbytes: 5.0  # noqa: E731  the model's time for any bucket
    rank0 = StepView(0, 0, 0.0, 30.0, buckets=[BucketBar(0, 1.0, 7.0, 100), BucketBar(1, 2.0, 20.0, 100)])
    rank1 = StepView(1, 0, 0.0, 30.0, buckets=[BucketBar(0, 1.5, 7.0, 100), BucketBar(1, 15.0, 20.0, 100)])
    first, second = les.explain_bars([rank0, rank1], wire, taken_ms=[1.0, 7.0])
    # Bucket 0: on the wire at once, 5 ms by the model, then 1 ms this machine added.
    assert (first["bar"], first["queued"], first["wire"], first["late_peer"]) == (6.0, 0.0, 5.0, 0.0)
    assert first["rest"] == pytest.approx(1.0)
    # Bucket 1: queued 2..7 behind bucket 0, modelled to end at 12, but rank 1 launched it only at 15.
    assert (second["queued"], second["wire"], second["late_peer"]) == (5.0, 5.0, 3.0)
    assert second["rest"] == pytest.approx(5.0) and second["bar"] == 18.0


def test_16_queues_a_bar_until_the_link_took_it_not_until_the_bar_before_was_stamped():
    # A busy core: the link freed the wire at 7 ms and took bucket 1 at once, but the callback that
    # stamps bucket 0's end in the trace ran only at 9 ms. Bucket 1 ended on time, at 7 + 5 + 0.2.
    les = lesson("16_overlap_trace")
    wire = lambda nbytes: 5.0  # noqa: E731
    views = [StepView(r, 0, 0.0, 30.0, buckets=[BucketBar(0, 1.0, 9.0, 100), BucketBar(1, 2.0, 12.2, 100)])
             for r in (0, 1)]
    first, second = les.explain_bars(views, wire, taken_ms=[1.0, 7.0])
    assert (second["queued"], second["wire"], second["late_peer"]) == (5.0, 5.0, 0.0)
    assert second["rest"] == pytest.approx(0.2)  # not -1.8 ms, as queueing until the stamped 9 ms would say
    assert first["rest"] == pytest.approx(3.0)  # the late stamp is this machine's delay, in bucket 0's bar


def profile(backward_ms: float) -> ComputeProfile:
    """26 gradients shaped like lesson 17's model, ready evenly over ``backward_ms``."""
    sizes = [40, 10 * 512 * 4] + [512 * 4, 512 * 512 * 4] * 12
    return ComputeProfile(backward_ms / 2, [Gradient(f"g{i}", backward_ms * (i + 1) / len(sizes), n)
                                            for i, n in enumerate(sizes)])


@pytest.mark.parametrize("backward_ms", [300.0, 45.0, 0.9, 0.05], ids=["busy laptop", "laptop", "gpu 50x", "gpu 1000x"])
@pytest.mark.parametrize("network", ["ib400", "dgx-h100", "eth100"])
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_17_claims_hold_for_every_compute_speed_network_and_algorithm(backward_ms, network, algorithm):
    les = lesson("17_how_ddp_scales")
    policies = {"per parameter": DDPPolicy(bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6, algorithm=algorithm),
                "25 MB": DDPPolicy(bucket_cap_mb=25, algorithm=algorithm),
                "one bucket": DDPPolicy(bucket_cap_mb=les.GIANT_MB, first_bucket_cap_mb=les.GIANT_MB, algorithm=algorithm)}
    les.check_claims(profile(backward_ms), ["eth25", network], policies)  # raises where a claim is wrong
    for name in ("eth25", network):
        les.scaling_table(profile(backward_ms), name, policies)
    if algorithm == "tree":
        les.ring_against_tree(["eth25", network])


@pytest.mark.parametrize("backward_ms", [1.0, 7.0, 30.0, 100.0, 300.0],
                         ids=["fast machine", "quiet laptop", "busy", "very busy", "crawling"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_17b_the_planner_picks_fewer_buckets_on_the_high_latency_link_for_any_backward(backward_ms, world_size):
    les = lesson("17b_auto_buckets")
    picks = les.model_choices(les.stated_profile(backward_ms), les.LINKS, world_size)
    buckets = {n: c.buckets for n, c in picks.items()}
    if backward_ms <= 30:
        assert buckets["high-latency"] < buckets["low-bandwidth"], buckets
    else:  # a backward 10x the wire's time hides either link's transfer: no plan is 2% faster than the default
        assert buckets["high-latency"] <= buckets["low-bandwidth"], buckets
    for choice in picks.values():
        assert choice.predicted_ms <= choice.default_ms


def test_17b_names_its_links_by_their_numbers():
    links = lesson("17b_auto_buckets").LINKS
    high, low = links["high-latency"], links["low-bandwidth"]
    assert high.alpha_s >= 100 * low.alpha_s, "the high-latency link pays far more per message"
    assert low.bandwidth_Bps < high.bandwidth_Bps, "the low-bandwidth link moves fewer bytes per second"


def test_17b_states_the_compute_of_its_own_model():
    les = lesson("17b_auto_buckets")
    common = lesson("_common")
    model = common.make_model(seed=0, width=les.WIDTH, depth=les.DEPTH)
    real = [p.numel() * p.element_size() for p in model.parameters()][::-1]  # last layer first, its bias before its weight
    stated = les.stated_profile()
    assert [g.nbytes for g in stated.gradients] == real
    assert stated.backward_ms == les.STATED_BACKWARD_MS and (les.FEATURES, les.CLASSES) == (common.FEATURES, common.CLASSES)
