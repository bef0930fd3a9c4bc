"""The simulated link: exact sums, delivered no earlier than the network model says.

Times are computed by hand from a made-up link (alpha 5 ms, 10 MB/s) so that
the predicted delays are tens of milliseconds: far above loopback's real cost,
far below a test's patience. Only lower bounds on time are asserted (a busy
machine may be slower, never faster than the model).
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minddp import MiniDDP
from minddp_lab.network import Link, PRESETS
from minddp_lab.simulated_link import SimulatedLink, simulated_allreduce_hook

SLOW = Link("slow", alpha_s=5e-3, bandwidth_Bps=10e6)


def test_predicted_time_is_the_ring_formula_by_hand():
    link = SimulatedLink(SLOW)
    # 2 ranks: 2(p-1) = 2 latencies, 2(p-1)/p = 1 times the bytes.
    assert link.predicted_time(100_000, world_size=2) == pytest.approx(2 * 5e-3 + 100_000 / 10e6)
    # 4 ranks: 6 latencies, 1.5 times the bytes.
    assert link.predicted_time(100_000, world_size=4) == pytest.approx(6 * 5e-3 + 1.5 * 100_000 / 10e6)
    assert SimulatedLink("laptop").link is PRESETS["laptop"]
    with pytest.raises(ValueError, match="unknown network"):
        SimulatedLink("no-such-link")


def _one_message(rank, world_size):
    link = SimulatedLink(SLOW)
    # 1 MB: 110 ms on the wire, so that launching (a thread started, a Gloo
    # work queued: well under a millisecond idle, a few ms on a loaded
    # machine) stays far below half of it whatever the load.
    t = torch.full((250_000,), float(rank + 1))
    start = time.perf_counter()
    fut = link.all_reduce(t)
    returned_after = time.perf_counter() - start
    result = fut.wait()
    took = time.perf_counter() - start
    assert torch.equal(result, torch.full((250_000,), 3.0)), "the real sum"
    return returned_after, took, link.predicted_time(t.nbytes)


def test_one_message_takes_at_least_the_predicted_time_and_launch_returns_at_once(ranks):
    for returned_after, took, predicted in ranks(2).run(_one_message):
        assert predicted == pytest.approx(0.11)  # 2 x 5 ms + 1 MB / 10 MB/s
        assert took >= predicted
        assert returned_after < predicted / 2, (
            f"launching must not wait for the wire: it returned after {returned_after * 1e3:.1f} ms, "
            f"the wire takes {predicted * 1e3:.0f} ms")


def _three_messages(rank, world_size):
    link = SimulatedLink(SLOW)
    tensors = [torch.full((n,), float(rank)) for n in (25_000, 250, 2_500)]
    order = []
    futures = []
    for i, t in enumerate(tensors):
        fut = link.all_reduce(t)
        fut.then(lambda f, i=i: order.append(i))
        futures.append(fut)
    torch.futures.wait_all(futures)
    spans = [(m.started, m.finished, m.predicted_s) for m in link.messages]
    return order, spans, [t[0].item() for t in tensors]


def test_messages_complete_in_launch_order_one_at_a_time(ranks):
    for order, spans, sums in ranks(2).run(_three_messages):
        # The small second message would finish first on a parallel wire.
        assert order == [0, 1, 2]
        assert sums == [1.0, 1.0, 1.0]
        for (_, finished, _), (started, _, _) in zip(spans, spans[1:]):
            assert started >= finished, "a message waits for the one before it"
        for started, finished, predicted in spans:
            assert finished - started >= predicted
        total = spans[-1][1] - spans[0][0]
        assert total >= sum(p for _, _, p in spans)


def _ddp_with_link(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = MiniDDP(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)))
    reference.module.load_state_dict(model.state_dict())
    ddp = MiniDDP(model, bucket_cap_mb=0.0001)  # several buckets (each closes after the gradient that reaches 104 B)
    link = SimulatedLink(SLOW)
    ddp.register_comm_hook(link, simulated_allreduce_hook)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()  # the first backward: one bucket, then the buckets are cut at the cap (torch's rule)
    for m in (model, reference):
        m.zero_grad()
    link.messages.clear()
    ddp(x).sum().backward()
    reference(x).sum().backward()
    same = all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(model.parameters(), reference.parameters()))
    return same, len(link.messages), len(ddp.bucket_names)


def test_as_a_comm_hook_it_averages_exactly_and_does_not_deadlock(ranks):
    for same, messages, buckets in ranks(2).run(_ddp_with_link, timeout_s=30):
        assert same, "the simulated link changes when gradients arrive, not what they are"
        assert messages == buckets > 1


def _halves(rank, world_size):
    link = SimulatedLink(SLOW)
    full = torch.arange(4 * 50_000, dtype=torch.float32) * (rank + 1)  # 800 kB
    piece = torch.empty(full.numel() // world_size)
    start = time.perf_counter()
    summed = link.reduce_scatter(piece, full)
    gathered = link.all_gather(torch.empty_like(full), summed.wait())  # launched when the first is back
    everything = gathered.wait()
    took = time.perf_counter() - start
    expected = torch.arange(4 * 50_000, dtype=torch.float32) * 3
    return (torch.equal(everything, expected), [(m.kind, m.nbytes, m.predicted_s) for m in link.messages], took)


def test_reduce_scatter_and_all_gather_cost_half_an_all_reduce_each_and_are_exact(ranks):
    for exact, messages, took in ranks(2).run(_halves, timeout_s=30):
        assert exact, "all-gather of the reduce-scattered pieces is the sum"
        # 2 ranks, 800 kB: one latency + half the bytes at 10 MB/s = 5 ms + 40 ms, each half.
        assert messages == [("reduce_scatter", 800_000, pytest.approx(0.045)),
                            ("all_gather", 800_000, pytest.approx(0.045))]
        assert took >= 0.09
