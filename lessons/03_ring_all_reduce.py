"""Lesson 03: all_reduce by hand -- the ring, and the parameter server it replaced.

What you will learn
    ``all_reduce`` is not magic; it is built from point-to-point messages
    (``send``/``recv``). Two ways to sum a tensor of N numbers over p ranks:

    * Parameter server: everyone sends its tensor to rank 0, rank 0 adds them
      and sends the sum back. Rank 0 sends (p-1)N numbers and receives as
      many; everyone else waits on that one link. Its traffic grows with
      every worker: from 2 workers to 4 it triples ((p-1)N: N, then 3N).
    * Ring: cut the tensor into p chunks and pass chunks around a ring
      (rank r sends to r+1, receives from r-1). First p-1 steps of
      *reduce-scatter* (each step, add the chunk you received to yours; at
      the end rank r owns the full sum of one chunk), then p-1 steps of
      *all-gather* (pass the finished chunks around). Every rank sends
      2(p-1)/p * N numbers: less than 2N, however many ranks there are.
      That is why the ring (and its cousins) is what NCCL and Gloo use.

What to run
    python lessons/03_ring_all_reduce.py [--world-size 4] [--blocking-send]

    A ring needs two ranks at least: given ``--world-size 1`` the lesson
    says so in one line and exits.

What to look at
    The ring step by step (3 ranks by default): which chunk each rank sends
    and which it receives, and who owns which finished sum after the
    reduce-scatter. Then the traffic table: numbers sent per rank, counted
    at every send for both patterns and compared with the formulas, and the
    formulas for larger p. The timings are measured on your machine over
    loopback, so take them as an illustration.

Try this
    Predict before you run; ``--reveal`` prints the answers.
    1. Predict which chunk rank 0 owns after the reduce-scatter for p = 3,
       then for ``--world-size 4``.
    2. ``--blocking-send``: the ring with a plain ``send`` before the
       ``recv`` instead of ``isend``. Predict what happens.
    3. The parameter server at ``--world-size 4``: predict rank 0's count.
"""

import datetime
import time

import torch
import torch.distributed as dist

from _common import parse_args, print0, print_ranks, run


def ring_all_reduce(x: torch.Tensor, log: list | None = None) -> tuple[torch.Tensor, int]:
    """Sum ``x`` over all ranks with a ring; return (sum, numbers this rank sent).

    ``log``, if given, receives one (phase, step, sent chunk, received chunk) per step.
    """
    p, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    # tensor_split always gives p pieces (chunk may give fewer). They are
    # views into `out`, so filling the pieces fills the result.
    out = x.clone()
    chunks = list(out.tensor_split(p))
    sent = 0

    # Reduce-scatter. At step s rank r passes on chunk (r - s), which by then
    # holds the sum over s+1 ranks, and adds its own numbers to chunk
    # (r - s - 1) coming from the left.
    for step in range(p - 1):
        send_i, recv_i = (r - step) % p, (r - step - 1) % p
        incoming = torch.empty_like(chunks[recv_i])
        # isend does not block: if every rank did a blocking send first,
        # each would wait for its neighbour to receive -- a deadlock.
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(incoming, src=left)
        request.wait()
        chunks[recv_i] += incoming
        sent += chunks[send_i].numel()
        if log is not None:
            log.append(("reduce-scatter", step, send_i, recv_i))
    # Now rank r holds the complete sum of chunk (r + 1) % p.

    # All-gather: pass the complete chunks around; receiving overwrites.
    for step in range(p - 1):
        send_i, recv_i = (r + 1 - step) % p, (r - step) % p
        request = dist.isend(chunks[send_i], dst=right)
        dist.recv(chunks[recv_i], src=left)
        request.wait()
        sent += chunks[send_i].numel()
        if log is not None:
            log.append(("all-gather", step, send_i, recv_i))
    return out, sent


def blocking_ring_step(x: torch.Tensor, group) -> None:
    """The first ring step written with a plain, blocking send: every rank sends first."""
    p, r = dist.get_world_size(), dist.get_rank()
    incoming = torch.empty_like(x)
    dist.send(x, dst=(r + 1) % p, group=group)  # waits until the right neighbour receives...
    dist.recv(incoming, src=(r - 1) % p, group=group)  # ...which it never reaches


def parameter_server_all_reduce(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Everyone to rank 0, rank 0 sums and sends back; return (sum, numbers sent)."""
    p, r = dist.get_world_size(), dist.get_rank()
    sent = 0
    if r == 0:
        total = x.clone()
        incoming = torch.empty_like(x)
        for src in range(1, p):  # one link, p-1 messages in a row
            dist.recv(incoming, src=src)
            total += incoming
        for dst in range(1, p):
            dist.send(total, dst=dst)
            sent += total.numel()
        return total, sent
    dist.send(x, dst=0)
    sent += x.numel()
    total = torch.empty_like(x)
    dist.recv(total, src=0)
    return total, sent


def timed(fn, x, repeats=3):
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(x)
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def show_blocking_send(rank: int, world_size: int) -> None:
    # A group of its own with a short timeout: the default group keeps its
    # long one, so the ranks can still meet and leave cleanly afterwards.
    # They meet on it first, so that the short timeout times the deadlock,
    # not a rank arriving late on a busy machine.
    dist.barrier()
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    start = time.perf_counter()
    try:
        blocking_ring_step(torch.ones(10), group)
        outcome = "finished (no deadlock?)"
    except RuntimeError as error:
        outcome = f"stuck in send for {time.perf_counter() - start:.1f} s, then: {str(error).split('] ')[-1][:60]}"
    print0("--blocking-send: every rank calls send() before recv() in the first ring step")
    print_ranks(outcome)
    outcomes = [None] * world_size
    dist.all_gather_object(outcomes, outcome.startswith("stuck"))
    assert all(outcomes), "a blocking send in a ring deadlocks"
    print0("checked: the ring with blocking sends deadlocked on every rank, as predicted; isend")
    print0("         (send without waiting, then recv) is what lets ring_all_reduce work.")


def show_ring_steps(log_per_rank: list, p: int) -> None:
    print0(f"the ring for p = {p}, step by step: 'c1 -> +c0' = sent chunk 1 right, added the chunk 0 from the left")
    print0("  phase          step | " + " | ".join(f"rank {r:<8}" for r in range(p)))
    for i, (phase, step, _, _) in enumerate(log_per_rank[0]):
        op = "+" if phase == "reduce-scatter" else "="
        cells = [f"c{log[i][2]} -> {op}c{log[i][3]}" for log in log_per_rank]
        print0(f"  {phase:<14} {step:>4} | " + " | ".join(f"{c:<13}" for c in cells))
        if phase == "reduce-scatter" and step == p - 2:
            print0("  " + "-" * 21 + "+ now rank r owns the full sum of chunk (r+1) mod p: " +
                   ", ".join(f"rank {r}: c{(r + 1) % p}" for r in range(p)))
    print0("  ('+' adds the incoming partial sum to your chunk; '=' overwrites it with a finished one)\n")


def main(rank: int, world_size: int, blocking_send: bool) -> None:
    if blocking_send:
        return show_blocking_send(rank, world_size)
    p = world_size
    n = p * 200_000  # divisible by p, so the traffic formula is exact
    # Whole numbers stored as floats add up exactly in any order, so the
    # hand-made sum can be compared with torch's using equality, not "close".
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 100, (n,), generator=gen).float()

    reference = x.clone()
    dist.all_reduce(reference)
    log = []
    ring, ring_sent = ring_all_reduce(x, log)
    logs = [None] * world_size
    dist.all_gather_object(logs, log)
    show_ring_steps(logs, p)
    owners = [logs[r][p - 2][3] for r in range(p)]  # the chunk received in the last reduce-scatter step
    assert owners == [(r + 1) % p for r in range(p)], owners
    ps, ps_sent = parameter_server_all_reduce(x)
    assert torch.equal(ring, reference), "ring all-reduce differs from dist.all_reduce"
    assert torch.equal(ps, reference), "parameter server differs from dist.all_reduce"
    assert ring_sent == 2 * (p - 1) * n // p
    assert ps_sent == ((p - 1) * n if rank == 0 else n)

    print0(f"summing N = {n:,} numbers over p = {p} ranks")
    print0("checked: ring == dist.all_reduce == parameter server, element for element\n")
    print0("numbers sent by each rank (counted at every send, and equal to the formulas):")
    print_ranks(f"ring {ring_sent:>10,} = 2(p-1)/p * N    parameter server {ps_sent:>10,}")

    print0("\nthe same formulas for larger jobs: numbers sent per rank, in units of N")
    print0("(each rank receives as many as it sends)")
    print0("      p | ring, every rank | parameter server, rank 0")
    for q in (2, 4, 8, 64, 1024):
        ring_q, server_q = 2 * (q - 1) / q, q - 1
        assert ring_q < 2
        print0(f"  {q:>5} | {ring_q:>16.3f} | {server_q:>8}")
    print0("  the ring's cost per rank stays below 2N; the server's grows with p.")

    t_ring = timed(lambda t: ring_all_reduce(t), x)
    t_ps = timed(lambda t: parameter_server_all_reduce(t), x)
    t_torch = timed(lambda t: dist.all_reduce(t.clone()), x)
    print0(f"\nmeasured here, one all-reduce of {n * 4 / 1e6:.1f} MB:")
    print0(f"  hand ring {t_ring * 1e3:7.1f} ms   parameter server {t_ps * 1e3:7.1f} ms   dist.all_reduce {t_torch * 1e3:7.1f} ms")
    print0("  (on one machine every 'link' is the same memory bus, so the ring's")
    print0("   advantage shows only with separate links, i.e. separate machines)")


if __name__ == "__main__":
    args = parse_args(__doc__, world_size=3, min_world_size=2,
                      extra=lambda p: p.add_argument("--blocking-send", action="store_true", help="the ring with plain sends: a deadlock"))
    run(main, args.world_size, args.blocking_send)
