"""The compute side of a step, read from a MiniDDP Chrome trace.

A :class:`ComputeProfile` is what the replay needs to know about one
training step on one rank, with the network taken out:

* ``forward_ms``: the wrapped module's forward;
* ``gradients``: for each parameter, when its gradient was ready, in ms since
  backward began (taken as the end of forward: the loss is part of backward
  here), with its size in bytes and its dtype, in arrival order;
* ``after_backward_ms``: from the last gradient to the next step's forward
  (writing the averaged gradients, the optimizer, ``zero_grad``, the next
  batch). With a single step in the trace: last gradient to grads written.

:func:`profile_from_trace` takes the median of each figure over every step
and rank of the trace. The best trace to take it from is a world-size-1 run
(``python -m minddp_lab.simulate --record MODEL``): its times hold no waiting
for a peer. A trace of a multi-rank run works too, but on a machine where
communication shares cores with backward, its gradient times are stretched.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace

from minddp.ddp.observers.trace import BACKWARD_TRACK

__all__ = ["Gradient", "ComputeProfile", "profile_from_trace", "load_profile", "save_profile", "save_profiles",
           "load_profiles"]


@dataclass(frozen=True)
class Gradient:
    name: str
    ready_ms: float  # since backward began
    nbytes: int
    dtype: str = "torch.float32"  # as str(tensor.dtype) writes it


# More gradient bytes than this on one rank is a typo or a broken trace (16 TiB: no GPU holds a tenth of it).
MAX_GRADIENT_BYTES = 2**44


def check_size(name: str, nbytes: object) -> None:
    """A gradient's size is a whole number of bytes >= 0; anything else is refused, naming the gradient."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"gradient {name!r} has {nbytes!r} bytes"
                         + (f" ({nbytes / 2**20:.3g} MiB)" if isinstance(nbytes, (int, float)) else "")
                         + ": a size must be a whole number of bytes >= 0")


@dataclass
class ComputeProfile:
    forward_ms: float
    gradients: list[Gradient] = field(default_factory=list)
    after_backward_ms: float = 0.0

    def __post_init__(self) -> None:
        for g in self.gradients:
            check_size(g.name, g.nbytes)
            if not (isinstance(g.ready_ms, (int, float)) and math.isfinite(g.ready_ms)):
                raise ValueError(f"gradient {g.name!r} is ready at {g.ready_ms!r} ms: must be a finite number")
        if self.gradient_bytes > MAX_GRADIENT_BYTES:
            raise ValueError(f"the gradients add up to {self.gradient_bytes:.3g} bytes ({self.gradient_bytes / 2**40:.3g} "
                             f"TiB), more than any GPU holds (the limit here is {MAX_GRADIENT_BYTES / 2**40:g} TiB)")
        for name in ("forward_ms", "after_backward_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} is {value!r}: must be a finite number of ms >= 0")

    @property
    def backward_ms(self) -> float:
        """Backward begins to last gradient ready."""
        return max((g.ready_ms for g in self.gradients), default=0.0)

    @property
    def gradient_bytes(self) -> int:
        return sum(g.nbytes for g in self.gradients)

    @property
    def step_ms(self) -> float:
        """One step without communication: forward + backward + after backward."""
        return self.forward_ms + self.backward_ms + self.after_backward_ms

    def scaled(self, factor: float) -> "ComputeProfile":
        """Every compute time divided by ``factor`` (e.g. 20 for "my GPU is 20x this CPU")."""
        if not factor > 0:
            raise ValueError(f"compute scale must be > 0, got {factor}")
        return ComputeProfile(
            self.forward_ms / factor,
            [replace(g, ready_ms=g.ready_ms / factor) for g in self.gradients],
            self.after_backward_ms / factor,
        )


    def with_times(self, step_ms: float | None = None, forward_ms: float | None = None,
                   backward_ms: float | None = None, after_backward_ms: float | None = None) -> "ComputeProfile":
        """The trace's shape at times you measured: ``step_ms`` (one step without DDP; every part scaled
        alike), or ``forward_ms`` and ``backward_ms`` (each part to its own; after backward scaled with
        backward unless ``after_backward_ms`` is given). When each gradient is ready keeps its share of
        backward."""
        given = {"step_ms": step_ms, "forward_ms": forward_ms, "backward_ms": backward_ms,
                 "after_backward_ms": after_backward_ms}
        for name, value in given.items():
            if value is not None and not (value > 0 and value < float("inf")):
                raise ValueError(f"{name} must be a number of ms > 0, got {value}")
        if step_ms is not None and (forward_ms is not None or backward_ms is not None):
            raise ValueError("give step_ms, or forward_ms and backward_ms, not both")
        if (forward_ms is None) != (backward_ms is None):
            raise ValueError("forward_ms and backward_ms go together (or give step_ms)")
        if self.forward_ms <= 0 or self.backward_ms <= 0:
            raise ValueError("the trace has no forward or backward time to scale")
        if step_ms is not None:
            if after_backward_ms is not None:
                raise ValueError("with step_ms, after backward is scaled with the rest: leave after_backward_ms out")
            return self.scaled(self.step_ms / step_ms)
        if forward_ms is None:
            return self if after_backward_ms is None else replace(self, after_backward_ms=after_backward_ms)
        k = backward_ms / self.backward_ms
        return ComputeProfile(forward_ms, [replace(g, ready_ms=g.ready_ms * k) for g in self.gradients],
                              self.after_backward_ms * k if after_backward_ms is None else after_backward_ms)


def _median(values: list[float], what: str) -> float:
    if not values:
        raise ValueError(f"the trace has no {what}: was it written by MiniDDP(..., trace=True)?")
    return statistics.median(values)


def profile_from_trace(trace: dict) -> ComputeProfile:
    """The median step of every rank and step in ``trace`` (a dict, as ``json.load`` returns it)."""
    steps: dict[tuple[int, int], dict] = {}  # (rank, step) -> its events
    for e in trace["traceEvents"]:
        if e.get("tid") != BACKWARD_TRACK or "step" not in e.get("args", {}):
            continue
        s = steps.setdefault((e["pid"], e["args"]["step"]), {"hooks": []})
        if e["ph"] == "X" and e["name"] == "forward":
            s["forward"] = (e["ts"] / 1e3, e["dur"] / 1e3)
        elif e["ph"] == "X" and e["name"].startswith("backward"):
            s["end"] = (e["ts"] + e["dur"]) / 1e3
        elif e["ph"] == "i" and e["name"].startswith("grad "):
            s["hooks"].append((e["ts"] / 1e3, e["name"].removeprefix("grad "), e["args"]))
    forward, after, written, ready = [], [], [], {}
    info: dict[str, tuple[int, str]] = {}
    for (rank, step), s in sorted(steps.items()):
        if "forward" not in s or not s["hooks"]:
            continue  # a no_sync step, or a trace without forward events
        start, duration = s["forward"]
        forward.append(duration)
        hooks = sorted(s["hooks"], key=lambda h: h[0])
        for ts, name, args in hooks:
            ready.setdefault(name, []).append(ts - (start + duration))
            check_size(name, args.get("bytes", 0))  # every step's event: the profile keeps only the last one's
            info[name] = (args.get("bytes", 0), args.get("dtype", "torch.float32"))
        following = steps.get((rank, step + 1), {}).get("forward")
        if following is not None:
            after.append(following[0] - hooks[-1][0])
        if "end" in s:
            written.append(s["end"] - hooks[-1][0])
    gradients = [Gradient(name, statistics.median(ts), *info[name]) for name, ts in ready.items()]
    gradients.sort(key=lambda g: g.ready_ms)
    after = after or written  # a single step: no next forward to measure to
    return ComputeProfile(_median(forward, "forward events with gradient hooks"), gradients,
                          statistics.median(after) if after else 0.0)


PROFILE_FORMAT = "minddp compute profile v1"


def _as_dict(profile: ComputeProfile) -> dict:
    return {"format": PROFILE_FORMAT, "forward_ms": profile.forward_ms, "after_backward_ms": profile.after_backward_ms,
            "gradients": [[g.name, round(g.ready_ms, 4), g.nbytes, g.dtype] for g in profile.gradients]}


def _from_dict(data: dict) -> ComputeProfile:
    try:
        gradients = [Gradient(*g) for g in data["gradients"]]
        return ComputeProfile(data["forward_ms"], gradients, data["after_backward_ms"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"a saved compute profile with a missing or malformed field ({e})") from None


def save_profile(profile: ComputeProfile, path: str) -> None:
    """Write ``profile`` as a small JSON file (a few bytes per gradient, not the whole trace)."""
    with open(path, "w") as f:
        json.dump(_as_dict(profile), f)


def save_profiles(profiles: dict[str, ComputeProfile], path: str) -> None:
    """Several named profiles in one small JSON file (:func:`load_profiles` reads it)."""
    with open(path, "w") as f:
        json.dump({name: _as_dict(p) for name, p in profiles.items()}, f, separators=(",", ":"))


def load_profiles(path: str) -> dict[str, ComputeProfile]:
    with open(path) as f:
        return {name: _from_dict(data) for name, data in json.load(f).items()}


def load_profile(path: str) -> ComputeProfile:
    """A profile from a Chrome trace of ``MiniDDP(trace=True)`` or a file of :func:`save_profile`."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and data.get("format") == PROFILE_FORMAT:
        return _from_dict(data)
    if not isinstance(data, dict) or "traceEvents" not in data:
        raise ValueError(f"{path} is neither a Chrome trace of MiniDDP(trace=True) nor a saved compute profile")
    try:
        return profile_from_trace(data)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"a trace event with a missing or malformed field ({type(e).__name__}: {e})") from None
