"""ZeRO stage 2 on MiniDDP: each bucket is reduce-scattered during backward, not all-reduced.

An all-reduce is a reduce-scatter followed by an all-gather. Stage 1 does the
whole all-reduce, keeps 1/N of the result and throws the rest away, then
all-gathers the parameters. Stage 2 stops after the reduce-scatter: each rank
receives only the averaged gradient of the elements it owns. Same bytes on
the wire as DDP (2 psi), and a full averaged gradient never exists anywhere.

So the partition follows MiniDDP's buckets: each bucket (zero padded to a
multiple of N) is cut into N equal pieces, rank r owning piece r of every
bucket. The reduce-scatter of a bucket then lands exactly in its owner's
shard, and it still starts as soon as the bucket is full: the overlap of
communication with backward stays. Three narrow contacts with MiniDDP:

One object, :class:`GradientSharding`, holds stage 2's state and makes
these contacts; the optimizer makes it (``shard_gradients=True``) and
MiniDDP's reducer knows it as a comm hook's state, a lender of buckets and
a :class:`~minddp.ddp.policies.Policy` told the end of each backward:

* a comm hook (:meth:`GradientSharding.reduce_scatter`, torch's contract) that divides
  the bucket by N, drops the ``.grad`` just copied into it, and
  reduce-scatters it, this rank's piece landing in the optimizer's shard
  gradient (straight into it where the piece lies there end to end; on
  Gloo by sends and receives, :mod:`minddp.zero.pairwise`);
* lent buckets (:func:`minddp.ddp.parts.lent_buckets.lend_buckets`, ``on_reduced``): told that
  the optimizer took the bucket, the reducer does not write ``.grad``, and
  the parameters' ``.grad`` are dropped (``None``) as soon as it is reduced;
* the reducer's bucket storage: buffers lent by a small pool
  (:mod:`minddp.zero.bucket_pool`), each the size of its bucket, taken at
  the bucket's first gradient (every gradient is copied into its slot at
  its hook and autograd's ``.grad`` let go, as DeepSpeed does), given back
  as soon as a bucket's piece has arrived, during backward, and none kept
  past the end of backward. At most ``BUCKET_BUFFERS`` buckets hold one at
  a time (``overlap_comm=False``: one), so the peak is the shard gradients
  (4 psi / N bytes in fp32) plus two buckets and one gradient, not a second
  copy of the model's gradients, and between steps nothing is left but the
  parameters, the optimizer state and its master shard (measured:
  ``tests/library/test_zero_stage2_memory.py``, ``tests/library/test_zero_stage2_defaults.py``,
  ``benchmarks/zero_memory_peers.py``).

The first backward is special when MiniDDP learns its bucket order
(``learn_bucket_order=True``, the default): the buckets are rebuilt at its
end, so a partition taken from them would not survive. That backward is
all-reduced as in DDP; the partition is (re)taken from the final buckets at
the first ``step()``, before any optimizer state exists.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from minddp.ddp.policies import Policy, add_policy, backwards_until_buckets_final
from minddp.ddp.default_hooks import GradBucket
from minddp.ddp.parts.bucket_views import BucketViews
from minddp.ddp.parts.gradient_cases import sparse_embedding_weights
from minddp.ddp.parts.lent_buckets import lend_buckets
from minddp.zero.bucket_pool import BucketPool
from minddp.collectives_compat import reduce_scatter_single
from minddp.zero.collectives import WorkFuture, completed
from minddp.zero.pairwise import reduce_scatter as reduce_scatter_pairwise
from minddp.zero.pairwise import runs_pairwise
from minddp.zero.partition import FlatUnit

# Pool buffers in use at once with overlap_comm=True (the default): one bucket's reduce-scatter on the
# wire while the next bucket fills the other (DeepSpeed's double buffer). With overlap_comm=False each
# reduce-scatter is waited for as it is sent: one buffer.
BUCKET_BUFFERS = 2

__all__ = ["GradientSharding", "bucket_units", "check_attachable", "check_buckets_unchanged", "missing_from"]


def bucket_units(ddp, world_size: int) -> list[FlatUnit]:
    """One unit per MiniDDP bucket, in launch order, cut into N equal pieces."""
    return [FlatUnit(list(bucket.params), world_size) for bucket in ddp.reducer.buckets]


def check_attachable(zero, ddp) -> None:
    """Errors that name what is wrong before anything is partitioned."""
    reducer = getattr(ddp, "reducer", None)
    if reducer is None or not hasattr(reducer, "set_gradients"):
        raise TypeError("shard_gradients=True needs ddp=<the MiniDDP model>: stage 2 changes how MiniDDP "
                        f"reduces its buckets (got ddp={type(ddp).__name__})")
    if backwards_until_buckets_final(reducer) is None:
        raise ValueError(
            "MiniDDP's buckets are still being planned (a policy such as a bucket planner rebuilds them after "
            "steps it measures), and ZeRO stage 2 (shard_gradients=True) partitions gradients by those buckets: "
            "leave the planner out (give MiniDDP a fixed bucket_cap_mb) to use them together")
    if ddp.process_group is not zero.process_group and \
            dist.get_process_group_ranks(ddp.process_group) != dist.get_process_group_ranks(zero.process_group):
        raise ValueError("shard_gradients=True: the optimizer and MiniDDP must use the same process group")


def missing_from(zero) -> list[str]:
    """Names of MiniDDP's parameters that are in no group of ``zero``.

    Stage 2 keeps no full gradient of any bucketed parameter, so each must be
    optimized here. Checked where the partition becomes final (the first
    step), not at construction: torch's usual order builds the optimizer on
    one group and adds the others with ``add_param_group``.
    """
    mine = {id(p) for g in zero.param_groups for p in g["params"]}
    return [name for bucket in zero.ddp.reducer.buckets for p, name in zip(bucket.params, bucket.names)
            if id(p) not in mine]


class GradientSharding(Policy):
    """ZeRO stage 2 on one MiniDDP: ``ddp`` reduce-scatters its buckets into ``zero``'s shards, from a pool."""

    def __init__(self, zero, ddp):
        self.zero, self.ddp, self.reducer = zero, ddp, ddp.reducer
        self.scattered: set[int] = set()  # buckets whose piece arrived in this backward, not yet taken
        self.in_flight: deque[WorkFuture] = deque()  # this backward's reduce-scatters not yet waited for, oldest first
        self.taken: list = []  # parameters of the buckets taken in this backward
        self.reducer_index = {id(p): i for i, p in enumerate(self.reducer.params)}  # where used_on_some_rank says
        self.bucket_pool = BucketPool(zero.world_size)
        self.pool_in_use = False
        ddp.register_comm_hook(self, GradientSharding.reduce_scatter)
        if not self.provisional:
            self.use_pool()
        add_policy(self.reducer, self)

    @property
    def provisional(self) -> bool:
        """Will MiniDDP rebuild its buckets at the end of this backward (its order still to learn)?"""
        return bool(backwards_until_buckets_final(self.reducer))

    def backwards_until_final(self) -> int:
        return 0  # stage 2 follows the buckets; it never rebuilds them

    def use_pool(self) -> None:
        """Buckets take their buffers from the pool from now on (after a step: its gradients were consumed).

        Not during the first backward when MiniDDP learns its bucket order:
        that one is all-reduced into ``.grad`` as in DDP, and its buckets are
        rebuilt at its end. Its ``.grad`` (bucket slots, with bucket views) are
        dropped here, once the first step has read them: stage 2 keeps no full
        gradient.
        """
        if self.pool_in_use or self.provisional:
            return
        reducer = self.reducer
        for bucket in reducer.buckets:
            for p in bucket.params:
                p.grad = None
        if self.bucket_pool.slots_at_hook:  # each gradient into its bucket at its hook: MiniDDP's bucket views
            sparse = sparse_embedding_weights(self.ddp.module)
            reducer.set_gradients(BucketViews(len(reducer.params),
                                              never=frozenset(i for i, p in enumerate(reducer.params)
                                                              if id(p) in sparse)))
        lend_buckets(reducer, self.bucket_pool, on_reduced=self._took)
        self.pool_in_use = True

    def reduce_scatter(self, bucket: GradBucket) -> torch.futures.Future:
        """The comm hook (``self`` its state): average the bucket, keep this rank's piece (into the shards)."""
        zero = self.zero
        buffer, group, n = bucket.buffer(), zero.process_group, zero.world_size
        divisor = self.reducer.divisor  # the world size, or the ranks still active under join()
        if self.provisional:  # as DDP: the whole average lands in .grad
            buffer.mul_(1.0 / divisor)
            if n == 1:
                return completed(buffer)
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda f: buffer)
        index = bucket.index()
        if index == 0:  # buckets launch in order: once per backward is enough
            check_buckets_unchanged(zero)
            self.in_flight.clear()
        self._wait_for_room()
        unit = zero.layout.units[index]
        buffer.mul_(1.0 / divisor)
        send = buffer if n * unit.piece == buffer.numel() else self.bucket_pool.padded(buffer, n * unit.piece)
        if send is None:  # pad to N equal pieces (a copy: the bucket's buffer has no room)
            send = torch.zeros(n * unit.piece, dtype=buffer.dtype, device=buffer.device)
            send[: buffer.numel()] = buffer
        for p, slot in zip(bucket.parameters(), bucket.gradients()):
            if p.grad is not slot:  # copied into the bucket: not needed any more (a slot goes with its buffer)
                p.grad = None
        zero.grads.begin_round()
        direct = _shard_slice(zero, index)  # received straight into the shard gradient, when it can be
        zero.grads.written_units.add(index)
        piece = direct if direct is not None else torch.empty(unit.piece, dtype=buffer.dtype, device=buffer.device)
        work = _start_reduce_scatter(send, piece, group)

        def arrived() -> None:
            if direct is None:
                zero.grads.receive_piece(index, piece)
            self.scattered.add(index)

        future = WorkFuture(work, buffer, arrived)
        if zero.overlap_comm:
            self.in_flight.append(future)
        else:  # one buffer in all: the next bucket fills it once this one has arrived (nothing else holds it)
            future.wait()
        return future

    def _wait_for_room(self) -> None:
        """Before a bucket is sent, wait for the older reduce-scatters: then at most ``BUCKET_BUFFERS``
        buckets hold a pool buffer, the one being sent and the next one filling.

        The pool lends a buffer to every bucket between its first gradient and
        its arrival. When backward outruns the network (here: small layers, two
        CPU cores), every bucket would be in flight at once and the pool would
        grow to the whole model. Bounded, a bucket's reduce-scatter still
        overlaps the next bucket's backward (DeepSpeed's ``overlap_comm`` makes
        the same trade). An arrived bucket's buffer goes back right after this
        launch (the reducer reclaims finished buckets then), before the next
        bucket's first gradient takes one: a second bucket still on the wire
        would make a third buffer.
        """
        in_flight = self.in_flight
        while in_flight and (in_flight[0].done() or len(in_flight) >= BUCKET_BUFFERS - 1):
            in_flight.popleft().wait()

    def _took(self, bucket: GradBucket) -> bool:
        """Lent buckets' ``on_reduced``: did the optimizer take this bucket? Then drop its ``.grad``."""
        if bucket.index() not in self.scattered:
            return False  # all-reduced (the first backward): the reducer writes .grad as usual
        self.scattered.discard(bucket.index())
        for p in bucket.parameters():
            p.grad = None  # its average lives, sharded, in the optimizer; no full gradient is kept
        self.taken += bucket.parameters()
        return True

    def after_backward(self) -> None:
        """End of a backward: note which parameters are stepped, and keep nothing bucket-sized until the next.

        Which taken parameters had a gradient on some rank is known only now (a
        bucket may have been taken during backward): those are stepped, one with
        no gradient anywhere is not. Every bucket has arrived: the finished
        reduce-scatters (which hold their buffers and received pieces) and the
        pool's free buffers are let go.
        """
        used = self.reducer.readiness.used_on_some_rank  # None: every parameter had a gradient
        self.zero.grads.used.update(id(p) for p in self.taken
                                    if used is None or used[self.reducer_index[id(p)]])
        self.taken = []
        self.in_flight.clear()
        self.bucket_pool.let_go()


def _start_reduce_scatter(send: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup):
    """Start summing this rank's piece of ``send`` over the ranks into ``piece``; the work to wait for
    (None: one rank, done already).

    On Gloo by hand (:mod:`minddp.zero.pairwise`: one exchange at two ranks,
    sends and receives at more): Gloo's ``reduce_scatter_tensor`` clones the
    whole bucket and all-reduces the clone, a bucket more memory at every
    launch and twice the bytes; by hand the other rank's piece is received
    straight into ``piece`` at two ranks.
    """
    if dist.get_world_size(group) == 1:
        piece.copy_(send)
        return None
    if runs_pairwise(group, send.device):
        return reduce_scatter_pairwise(send, piece.numel(), group, out=piece)
    return reduce_scatter_single(piece, send, group=group, async_op=True)


def _shard_slice(zero, index: int) -> torch.Tensor | None:
    """The slice of the shard gradient this rank's piece of bucket ``index`` is, if the reduce-scatter
    may write it there: the piece lies whole (no padding) in one shard, end to end, and nothing of
    this round is there yet (a second backward before the step adds to it: through a temporary)."""
    segments = zero.layout.unit_segments[index]
    unit = zero.layout.units[index]
    if index in zero.grads.written_units or not segments:
        return None
    shard, start = segments[0][1], segments[0][2]
    at = start
    for seg, in_shard, offset in segments:
        if in_shard is not shard or offset != at:
            return None
        at += seg.length
    if at - start != unit.piece:
        return None
    return shard.gradient()[start:at]


def check_buckets_unchanged(zero) -> None:
    """Retake the partition if MiniDDP rebuilt its buckets since; an error once that would lose state."""
    missing = missing_from(zero)
    if missing:
        raise ValueError(f"shard_gradients=True: MiniDDP parameters {missing} are in no parameter group of the "
                         "optimizer; stage 2 keeps no full gradient of a bucketed parameter, so all must be "
                         "optimized here (add them with add_param_group before the first step)")
    now = [[id(p) for p in b.params] for b in zero.ddp.reducer.buckets]
    if now == [[id(p) for p in u.params] for u in zero.layout.units[:len(now)]]:
        return
    if zero.partition_is_fixed:
        raise RuntimeError("ZeroRedundancyOptimizer(shard_gradients=True): MiniDDP's buckets changed after the "
                           "partition was fixed on them (the first synchronized backward must come before the "
                           "first step)")
    zero.repartition()
