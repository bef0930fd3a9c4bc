"""Bytes per rank: what DDP and ZeRO keep, counted from the tensors, beside the paper's formulas.

The ZeRO paper (Rajbhandari et al., 2020, section 3) counts mixed-precision
Adam: 2 bytes per parameter of fp16 weights, 2 of fp16 gradients and K = 12
of optimizer state (fp32 master copy, momentum, variance), so with psi
parameters on N ranks:

=========  =======================  ==========================
DDP        (2 + 2 + K) psi
stage 1    (2 + 2) psi + K psi / N  optimizer state sharded
stage 2    2 psi + (2 + K) psi / N  gradients sharded too
=========  =======================  ==========================

:func:`paper_bytes` evaluates them for any byte sizes (fp32 training with
AdamW: 4 + 4 + 8, the master copy being the parameters themselves).
:func:`measured_bytes` counts what a rank actually holds, by category, from
the tensors themselves (storage deduplicated: a view costs nothing). What the
formulas leave out is counted too: MiniDDP's bucket buffers (one more copy of
the gradients, which stage 2 does not free) and ZeRO's shard copy of the
parameters (the local optimizer steps a flat copy, 1/N of the model).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from minddp.ddp.parts.comm_hook import CommHook
from minddp.ddp.core.weak_hooks import after_accumulation

__all__ = ["paper_bytes", "measured_bytes", "optimizer_state_bytes", "gradient_bytes", "GradientPeak",
           "allocation_peak"]


def paper_bytes(stage: int, numel: int, world_size: int, param_bytes: int = 2, grad_bytes: int = 2,
                state_bytes: int = 12) -> float:
    """Bytes per rank by the paper's formula; ``stage`` 0 is DDP."""
    p, g, k = param_bytes * numel, grad_bytes * numel, state_bytes * numel
    if stage == 0:
        return p + g + k
    if stage == 1:
        return p + g + k / world_size
    if stage == 2:
        return p + (g + k) / world_size
    raise ValueError(f"stage must be 0 (DDP), 1 or 2, got {stage}")


def _unique_bytes(tensors: Iterable[torch.Tensor | None], seen: set) -> int:
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.device)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in an optimizer's state (ZeRO's: this rank's shard)."""
    optimizer = getattr(optimizer, "optim", optimizer)  # a ZeroRedundancyOptimizer's local optimizer
    return _unique_bytes((v for st in optimizer.state.values() for v in st.values()), set())


def measured_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes by category: params, grads, optimizer state, shard copy, buckets."""
    seen: set = set()
    module = getattr(model, "module", model)
    out = {"params": _unique_bytes(module.parameters(), seen)}
    layout = getattr(optimizer, "layout", None)
    shard_grads = [s.master.grad for s in layout.shards] if layout is not None else []
    out["grads"] = _unique_bytes([p.grad for p in module.parameters()] + shard_grads, seen)
    out["optimizer_state"] = optimizer_state_bytes(optimizer)
    out["shard_params"] = _unique_bytes([s.master for s in layout.shards], seen) if layout is not None else 0
    out["bucket_buffers"] = _unique_bytes(_bucket_buffers(model, optimizer), seen)
    return out


def _bucket_buffers(model: nn.Module, optimizer) -> list[torch.Tensor | None]:
    """MiniDDP's bucket buffers, and stage 2's pool (lent ones are both: counted once)."""
    reducer = getattr(model, "reducer", None)
    pool = getattr(optimizer, "bucket_pool", None)
    return ([b.buffer for b in reducer.buckets] if reducer is not None else []) + \
        (pool.buffers if pool is not None else [])


def gradient_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds for gradients now: ``.grad``, MiniDDP's bucket buffers (stage 2: its pool),
    ZeRO's shard gradients (a view costs nothing: a ``.grad`` that is a bucket slot counts once)."""
    module = getattr(model, "module", model)
    layout = getattr(optimizer, "layout", None)
    shard_grads = [s.master.grad for s in layout.shards] if layout is not None else []
    return _unique_bytes([p.grad for p in module.parameters()] + shard_grads + _bucket_buffers(model, optimizer),
                         set())


class GradientPeak:
    """The most gradient bytes (:func:`gradient_bytes`) held at once during backward.

    Sampled as each gradient arrives (a post-accumulate hook on every
    parameter of ``module``: build it *before* wrapping the module in
    MiniDDP, so it runs before MiniDDP's own hook, while a fresh ``.grad``
    and the bucket it goes into both exist) and as each bucket is sent
    (:meth:`watch` wraps the comm hook: a bucket full, its ``.grad`` not yet
    dropped). Then :meth:`sample` once more after backward, by the caller.
    """

    def __init__(self, module: nn.Module):
        self.peak = 0
        self._count = None
        after_accumulation(self._on_gradient, [p for p in module.parameters() if p.requires_grad])

    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> "GradientPeak":
        """Count ``model``'s (and ``optimizer``'s) gradients from now on; after any comm hook is registered."""
        self._count = lambda: gradient_bytes(model, optimizer)
        reducer = getattr(model, "reducer", None)
        if reducer is not None and reducer.communication.comm_hook is not None:
            state, hook = reducer.communication.comm_hook

            def sampled(state, bucket):
                self.sample()
                return hook(state, bucket)
            reducer.set_communication(CommHook(reducer, state, sampled))  # the same hook, sampled first
        return self

    def _on_gradient(self, param: torch.Tensor) -> None:
        self.sample()

    def sample(self) -> int:
        now = self._count() if self._count is not None else 0
        self.peak = max(self.peak, now)
        return now

    def reset(self) -> None:
        self.peak = 0


def allocation_peak(run: Callable[[], object]) -> tuple[int, int]:
    """Run ``run()`` under torch's profiler: (the most bytes allocated at once above the start, the bytes
    still allocated at its end). Every allocation counts, whichever code made it (a collective's hidden
    copy too): the profiler sees the allocator, not the tensors Python can reach. The first minus the
    second is what ``run`` needed only for a while (a temporary, a received piece)."""
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        run()
    live = peak = 0
    for event in sorted(prof.function_events, key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak, live
