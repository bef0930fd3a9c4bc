"""DDP and ZeRO stages 1, 2 and 3 at any world size: bytes per rank, step time, bytes on the wire.

Memory is the ZeRO paper's formula (Rajbhandari et al. 2020, section 3.1),
:func:`minddp.zero.memory.paper_bytes`, with Ψ parameters on N ranks:

=========  ==========================  ===========================
setup      mixed precision (K = 12)    fp32 (what minddp measures)
=========  ==========================  ===========================
DDP        (2 + 2 + 12) Ψ              (4 + 4 + 8) Ψ
stage 1    (2 + 2) Ψ + 12 Ψ / N        (4 + 4) Ψ + 8 Ψ / N
stage 2    2 Ψ + (2 + 12) Ψ / N        4 Ψ + (4 + 8) Ψ / N
stage 3    (2 + 2 + 12) Ψ / N          (4 + 4 + 8) Ψ / N
=========  ==========================  ===========================

Stage 3's figure adds the working set of :mod:`minddp_lab.simulate.stage3`: the
units held in full at once (two with prefetch, each with its parameters and
gradient), which the paper's formula leaves out and which sets the floor at
large N.

Step time is the replay of :mod:`minddp_lab.simulate.replay` (buckets in order,
one collective on the wire, overlapped with backward) with each setup's
collectives, as :mod:`minddp.zero` runs them:

* **DDP**: every bucket all-reduced during backward; the optimizer steps
  all Ψ parameters.
* **stage 1**: the same all-reduces (torch's ``ZeroRedundancyOptimizer`` and
  ``minddp.zero`` on a DDP wrapper), the optimizer steps Ψ/N, then the
  parameters are all-gathered, after the step: 3Ψ on the wire, not the
  paper's 2Ψ (its stage 1 reduce-scatters, as stage 2 does here).
* **stage 2**: every bucket *reduce-scattered* during backward (half an
  all-reduce, overlapped the same way), the optimizer steps Ψ/N, then the
  all-gather: reduce-scatter + all-gather = one all-reduce, 2Ψ.

* **stage 3**: no buckets; :func:`minddp_lab.simulate.stage3.simulate_stage3`
  replays it unit by unit (one unit per layer): all-gather before each
  unit's forward and again before its backward, reduce-scatter after it,
  the next unit prefetched; 3Ψ on the wire.

For stages 1 and 2 the all-gather runs after the step, bucket by bucket, and nothing hides it
(``minddp.zero`` gathers at the end of ``step()``; DeepSpeed's prefetching
into the next forward is not modelled). The optimizer's time is the
profile's ``after_backward_ms``; ZeRO divides it by N.

A model given only by its size gets a compute profile from the usual
estimate of training FLOPs (forward 2Ψ per token, backward 4Ψ, Kaplan et
al. 2020) at an achieved rate, its gradients ready in equal per-layer
chunks spread evenly over backward, and an optimizer step bound by memory
bandwidth (Adam reads the gradient and reads and writes weights, momentum
and variance: 28 bytes per parameter in either precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from minddp_lab.network import Hierarchy, Link, all_gather_time, bytes_sent_per_rank
from minddp_lab.simulate.profile import ComputeProfile, Gradient
from minddp_lab.simulate.replay import DDPPolicy, SimulatedStep, simulate_step
from minddp_lab.simulate.stage3 import Stage3Policy, Stage3Step, Unit, simulate_stage3, working_set_bytes
from minddp.zero.memory import paper_bytes

__all__ = ["SETUPS", "PRECISIONS", "MODELS", "ModelSize", "Compute", "ZeroStep", "memory_per_rank",
           "zero_step", "profile_for", "units_for", "predict", "get_model"]

SETUPS = ("ddp", "stage1", "stage2", "stage3")
# (parameter, gradient, optimizer-state) bytes per parameter, and the gradients' dtype.
PRECISIONS = {"mixed": (2, 2, 12, "torch.float16"), "fp32": (4, 4, 8, "torch.float32")}
OPTIMIZER_BYTES_PER_PARAM = 28  # Adam: read gradient; read and write weights, momentum, variance


@dataclass(frozen=True)
class ModelSize:
    name: str
    params: float  # Ψ
    layers: int  # gradients arrive in this many equal chunks
    source: str = ""


MODELS = {m.name: m for m in [
    ModelSize("gpt2-xl", 1.5e9, 48, "GPT-2 XL: 1.5 B parameters, 48 layers (Radford et al. 2019, table 2)"),
    ModelSize("7.5b", 7.5e9, 72, "the ZeRO paper's example, 7.5 B parameters (section 3.1, figure 1); "
              "72 layers assumed (Megatron-LM's 8.3 B model has 72)"),
    ModelSize("gpt3-175b", 175e9, 96, "GPT-3: 175 B parameters, 96 layers (Brown et al. 2020, table 2.1)"),
]}


def get_model(name: str) -> ModelSize:
    """A :data:`MODELS` preset, or a parameter count such as ``"13e9"`` (72 layers assumed)."""
    if name in MODELS:
        return MODELS[name]
    try:
        params = float(name)
    except ValueError:
        raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}, or a parameter count like 13e9") from None
    if not params >= 1:
        raise ValueError(f"a model needs at least one parameter, got {name!r}")
    return ModelSize(name, params, 72, "given by its parameter count; 72 layers assumed")


@dataclass(frozen=True)
class Compute:
    """One rank's compute, assumed: an H100 SXM at 40% of its dense bf16 peak."""

    tflops: float = 400.0  # achieved; peak 989 TFLOPS dense bf16 (NVIDIA H100 datasheet)
    tokens_per_rank: int = 16384  # per step: 8 sequences of 2,048
    memory_Bps: float = 3.35e12  # HBM3, H100 SXM datasheet: what bounds the optimizer step


def memory_per_rank(setup: str, params: float, world_size: int, precision: str = "mixed") -> float:
    """Bytes per rank by the paper's formula (parameters, gradients, optimizer state; no activations)."""
    p, g, k, _ = _precision(precision)
    if _setup(setup) == "stage3":
        return (p + g + k) * params / world_size  # paper_bytes knows stages 0-2; stage 3 shards everything
    return paper_bytes(SETUPS.index(setup), params, world_size, p, g, k)


def profile_for(model: ModelSize, compute: Compute = Compute(), precision: str = "mixed") -> ComputeProfile:
    """A world-size-1 compute profile for ``model``: see the module doc."""
    _, grad_bytes, _, dtype = _precision(precision)
    ms_per_flop = 1e3 / (compute.tflops * 1e12)
    forward = 2 * model.params * compute.tokens_per_rank * ms_per_flop
    backward = 2 * forward
    chunk = math.ceil(model.params / model.layers)
    gradients = [Gradient(f"layer{model.layers - 1 - i}", backward * (i + 1) / model.layers, chunk * grad_bytes, dtype)
                 for i in range(model.layers)]  # the last layer's first
    optimizer = OPTIMIZER_BYTES_PER_PARAM * model.params / compute.memory_Bps * 1e3
    return ComputeProfile(forward, gradients, optimizer)


def units_for(model: ModelSize, compute: Compute = Compute(), precision: str = "mixed") -> list[Unit]:
    """Stage 3's units for ``model``: one per layer, equal, with :func:`profile_for`'s compute shared out."""
    p, g, _, _ = _precision(precision)
    profile = profile_for(model, compute, precision)
    per_layer = math.ceil(model.params / model.layers)
    return [Unit(f"layer{i}", per_layer * p, per_layer * g, profile.forward_ms / model.layers,
                 profile.backward_ms / model.layers) for i in range(model.layers)]


@dataclass
class ZeroStep:
    setup: str
    world_size: int
    replay: SimulatedStep  # backward with its bucket reductions, and the (sharded) optimizer step
    gather_ms: float  # the parameters' all-gather after the step (stages 1 and 2)
    wire_bytes: float  # each rank sends, per step (rings)

    @property
    def step_ms(self) -> float:
        return self.replay.step_ms + self.gather_ms


def zero_step(profile: ComputeProfile, network: Link | Hierarchy, world_size: int, setup: str,
              policy: DDPPolicy = DDPPolicy()) -> ZeroStep:
    """One optimizer step of ``setup`` on ``world_size`` ranks; ``profile.after_backward_ms`` is the
    unsharded optimizer step. Parameters are taken to have the gradients' dtype."""
    setup = _setup(setup)
    if setup == "stage3":
        raise ValueError("stage 3 has units, not buckets: replay it with minddp_lab.simulate.stage3.simulate_stage3 "
                         "(or predict(model, ...) for a model given by its size)")
    sharded = setup != "ddp"
    collective = "reduce_scatter" if setup == "stage2" else "all_reduce"
    if sharded:
        profile = replace(profile, after_backward_ms=profile.after_backward_ms / world_size)
    step = simulate_step(profile, network, world_size, replace(policy, collective=collective))
    wire = sum(bytes_sent_per_rank(collective, b.wire_bytes, world_size) for b in step.buckets)
    gather_ms = 0.0
    if sharded:
        # The same buckets come back as parameters, uncompressed.
        gather_ms = sum(all_gather_time(b.nbytes, world_size, network) for b in step.buckets) * 1e3
        wire += sum(bytes_sent_per_rank("all_gather", b.nbytes, world_size) for b in step.buckets)
    return ZeroStep(setup, world_size, step, gather_ms, wire)


def predict(model: ModelSize, network: Link | Hierarchy, world_size: int, setup: str, *, precision: str = "mixed",
            compute: Compute = Compute(), policy: DDPPolicy = DDPPolicy(),
            stage3: Stage3Policy = Stage3Policy()) -> tuple[float, ZeroStep | Stage3Step]:
    """(bytes per rank, simulated step) of ``model`` under ``setup``; stage 3's bytes include its working set."""
    if _setup(setup) == "stage3":
        units = units_for(model, compute, precision)
        optimizer_ms = profile_for(model, compute, precision).after_backward_ms
        step3 = simulate_stage3(units, network, world_size, optimizer_ms, stage3)
        return memory_per_rank(setup, model.params, world_size, precision) + working_set_bytes(units, stage3), step3
    step = zero_step(profile_for(model, compute, precision), network, world_size, setup, policy)
    return memory_per_rank(setup, model.params, world_size, precision), step


def _setup(setup: str) -> str:
    if setup not in SETUPS:
        raise ValueError(f"setup must be one of {', '.join(SETUPS)}, got {setup!r}")
    return setup


def _precision(precision: str) -> tuple[int, int, int, str]:
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}") from None
