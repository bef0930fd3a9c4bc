"""BatchNorm whose statistics cover the whole global batch, not one rank's slice.

Under data parallelism each rank sees ``B / R`` samples. Plain BatchNorm then
normalizes with the statistics of that small slice, which is noisier than the
batch a single process would see, and its running statistics drift apart from
rank to rank. :class:`SyncBatchNorm` makes the ranks agree: in training mode
every forward combines the per-rank statistics, and every backward combines
the two reductions the input gradient needs. With it, R ranks holding slices
of one batch compute what one process holding the whole batch would.

Forward, per channel (``n_r`` samples on rank ``r``; ranks may hold different
counts, also zero)::

    local:   n_r, mean_r, M2_r = sum over rank r's slice of (x - mean_r)^2
    gather:  all ranks' (n_r, mean_r, M2_r)          one all_gather, 2C+1 numbers
    combine: n    = sum n_r
             mean = sum n_r mean_r / n
             M2   = sum [M2_r + n_r (mean_r - mean)^2]
             var  = M2 / n           (normalization: biased, as BatchNorm)
    y = (x - mean) / sqrt(var + eps) * weight + bias
    running_mean <- (1 - f) running_mean + f mean
    running_var  <- (1 - f) running_var  + f M2 / (n - 1)   (unbiased)

Backward, with ``xhat = (x - mean) / sqrt(var + eps)``::

    all_reduce: sum dy, sum dy * xhat                 one all_reduce, 2C numbers
    dx = weight / sqrt(var + eps) * (dy - sum dy / n - xhat * sum(dy * xhat) / n)
    dweight, dbias = the *local* sums (the DDP wrapper then averages them over
                     ranks like any other gradient)

Why gather means and M2 instead of all-reducing sums and sums of squares:
the shortcut ``var = E[x^2] - E[x]^2`` subtracts two large, nearly equal
numbers when a channel's mean is large against its spread, and in float32
the difference can lose every significant digit (even come out negative).
Each rank instead computes its local mean and M2 with ``torch.var_mean``
(which centres the data itself), and the parallel combination above (Chan,
Golub and LeVeque, 1979) adds only non-negative terms, in float64. The price
is an all_gather of R x (2C+1) numbers instead of an all_reduce of 2C+1,
which is nothing next to a model's gradients.

Unlike ``torch.nn.SyncBatchNorm``, which only synchronizes on GPUs, this works
with any backend, Gloo on CPU included. In eval mode, with a world of one, or
without an initialized process group it is plain BatchNorm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm"]


def _reduced_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))  # every dim but the channel dim


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Shape a per-channel vector [C] to broadcast against x [N, C, ...]."""
    return v.reshape([1, -1] + [1] * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group, world_size):
        channels = x.shape[1]
        dims = _reduced_dims(x)
        # Statistics in at least float32, also for half-precision inputs.
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        n_local = x.numel() // channels if channels else 0

        if n_local > 0:
            var_local, mean_local = torch.var_mean(xc, dim=dims, correction=0)
            m2_local = var_local * n_local
        else:  # an empty slice contributes nothing (and var_mean would give NaN)
            mean_local = torch.zeros(channels, dtype=compute, device=x.device)
            m2_local = torch.zeros_like(mean_local)
        # torch.full writes the number on the device; torch.tensor([n]) would copy it from the host.
        count = torch.full((1,), float(n_local), dtype=torch.float64, device=x.device)
        local = torch.cat([count, mean_local.double(), m2_local.double()])

        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        table = torch.stack(gathered)  # [R, 2C+1]
        counts = table[:, :1]  # [R, 1]
        means = table[:, 1 : 1 + channels]
        m2s = table[:, 1 + channels :]

        # The one wait for the GPU per layer and forward (torch's SyncBatchNorm has
        # one too, dropping empty ranks' rows): every rank must see the same n to
        # raise together below, rather than leave the others waiting.
        n = int(counts.sum().item())
        ctx.n, ctx.group, ctx.has_bias = n, group, bias is not None
        if n == 0:  # every rank's slice is empty: an empty output, statistics untouched (as torch's)
            ctx.save_for_backward(x, weight, mean_local, mean_local)
            return torch.empty_like(x)
        if n == 1:  # the same n on every rank, so every rank raises: no hang
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {n} over "
                f"{world_size} ranks (input shape on this rank: {list(x.shape)})"
            )
        mean = (counts * means).sum(0) / n
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / n
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None:
            with torch.no_grad():
                running_mean.copy_((1 - factor) * running_mean.double() + factor * mean)
        if running_var is not None:
            with torch.no_grad():
                running_var.copy_((1 - factor) * running_var.double() + factor * m2 / (n - 1))

        mean_c, invstd_c = mean.to(compute), invstd.to(compute)
        y = (xc - _per_channel(mean_c, x)) * _per_channel(invstd_c, x)
        if weight is not None:
            y = y * _per_channel(weight.to(compute), x)
        if bias is not None:
            y = y + _per_channel(bias.to(compute), x)

        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = _reduced_dims(x)
        compute = mean.dtype
        dy = grad_out.to(compute)
        xhat = (x.to(compute) - _per_channel(mean, x)) * _per_channel(invstd, x)
        # Local reductions (zeros for an empty slice).
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else compute)
        if ctx.needs_input_grad[0] and ctx.n == 0:
            grad_x = torch.zeros_like(x)  # n is the same on every rank: none of them all-reduces
        elif ctx.needs_input_grad[0]:
            # needs_input_grad is the same on every rank (same model), so
            # either every rank reaches this all_reduce or none does.
            both = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(both, group=ctx.group)
            total_dy, total_dy_xhat = both.chunk(2)
            scale = invstd if weight is None else invstd * weight.to(compute)
            grad_x = _per_channel(scale, x) * (
                dy - _per_channel(total_dy / ctx.n, x) - xhat * _per_channel(total_dy_xhat / ctx.n, x)
            )
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the batch of all ranks together (see the module docstring).

    Takes the arguments of ``nn.BatchNorm2d`` plus ``process_group`` (default:
    the whole world), and inputs of any BatchNorm: ``[N, C]``, ``[N, C, L]``,
    ``[N, C, H, W]`` or ``[N, C, D, H, W]``. Every rank in the group must call
    forward (and backward) the same number of times, like any collective; a
    rank may pass an empty batch.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: dist.ProcessGroup | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(
                f"SyncBatchNorm expects 2D to 5D input [N, C, ...] (the shapes of BatchNorm1d/2d/3d), "
                f"got {input.dim()}D input of shape {list(input.shape)}"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm has num_features={self.num_features}, but the input has "
                f"{input.shape[1]} channels (shape {list(input.shape)})"
            )

    def _world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        # Momentum and the step counter exactly as nn.BatchNorm does them.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative average over all steps so far
                factor = 1.0 / float(self.num_batches_tracked)
        # Batch statistics in training, and in eval when there are no running ones.
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        update = not self.training or self.track_running_stats
        running_mean = self.running_mean if update else None
        running_var = self.running_var if update else None

        world_size = self._world_size() if self.training else 1  # eval never communicates
        if world_size == 1:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.process_group, world_size
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: dist.ProcessGroup | None = None) -> nn.Module:
        """Replace every BatchNorm layer in ``module`` (recursively) by a SyncBatchNorm.

        The new layers take over the old ones' parameter and buffer objects
        (so an optimizer built earlier still holds the right tensors, and
        ``requires_grad`` is kept) and their training flag. Returns the
        module, or a new layer when ``module`` itself is a BatchNorm.
        """
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
            )
            if module.affine:
                converted.weight = module.weight
                converted.bias = module.bias  # may be None (BatchNorm with bias=False)
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
