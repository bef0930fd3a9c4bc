"""Taking a trace to simulate from: a few traced MiniDDP steps of a model.

The model is one of ``minddp_lab.models``' names (``mlp``, ``cnn``...) or your
own, named ``module:function`` or ``path/to/file.py:function``: a function
that takes no arguments and returns ``(model, batch)`` or ``(model, batch,
loss_fn)``. ``batch`` is a tensor, or a tuple of tensors given to
``model(*batch)``; without ``loss_fn`` the loss is the mean of the output
(what backward computes is the same work whatever the loss).

The same as these lines in your own training script (every rank calls the
export; rank 0 writes)::

    ddp = MiniDDP(model, trace=True)
    for step in range(warmup + steps):
        if step == warmup:
            ddp.tracer.clear()          # drop allocation and bucket-rebuild steps
        opt.zero_grad(); loss_fn(ddp(x), y).backward(); opt.step()
    ddp.tracer.export_chrome_trace("run.json")

World size 1 (the default) gives the cleanest compute profile: no rank
waits for a peer, and no all-reduce competes with backward for the cores.

This is the command line's helper, the one part of the simulator that runs
a model; the replay never imports it (``tests/repository/test_layout.py`` counts it
with the floor above the core). Its functions live here, not in
``__main__``, because spawned ranks cannot import a ``__main__`` module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

import torch

from minddp import MiniDDP
from minddp.launch import RankFailed, spawn
from minddp_lab.models import MODEL_NAMES, build_model, model_loss

__all__ = ["record_trace", "load_builder", "built_model"]

BATCH_SIZE = 32
WARMUP_STEPS = 3


def load_builder(spec: str) -> Callable:
    """The function named by ``module:function`` or ``file.py:function``; ValueError saying what is wrong."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"--record: {spec!r} is neither a model of minddp_lab.models ({', '.join(MODEL_NAMES)}) "
                         "nor module:function / file.py:function")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ValueError(f"--record: no file {where!r}")
            loader = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as e:
        raise ValueError(f"--record: cannot import {where!r} ({e})") from None
    except Exception as e:  # the user's module raised while it was imported
        raise ValueError(f"--record: importing {where!r} raised {type(e).__name__}: {e}") from None
    builder = getattr(module, name, None)
    if not callable(builder):
        raise ValueError(f"--record: {where!r} has no function {name!r}")
    return builder


def built_model(spec: str) -> tuple[torch.nn.Module, tuple, Callable]:
    """``(model, inputs, loss_fn)`` from a builder spec; ValueError if it returns something else."""
    built = load_builder(spec)()
    if not isinstance(built, tuple) or len(built) not in (2, 3) or not isinstance(built[0], torch.nn.Module):
        raise ValueError(f"--record: {spec}() must return (model, batch) or (model, batch, loss_fn), "
                         f"got {type(built).__name__}")
    model, batch = built[0], built[1]
    inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    loss_fn = built[2] if len(built) == 3 else (lambda out: (out[0] if isinstance(out, (tuple, list)) else out).float().mean())
    return model, inputs, loss_fn


def _named_model(name: str, rank: int) -> tuple[torch.nn.Module, tuple, Callable]:
    data = torch.Generator().manual_seed(100 + rank)
    x, y = torch.rand(BATCH_SIZE, 1, 28, 28, generator=data), torch.randint(0, 10, (BATCH_SIZE,), generator=data)
    return build_model(name), (x,), lambda out: model_loss(name, out, x, y)


def _rank(rank: int, world_size: int, spec: str, path: str, steps: int, warmup: int, options: dict) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs, loss_fn = _named_model(spec, rank) if spec in MODEL_NAMES else built_model(spec)
    ddp = MiniDDP(model, trace=True, **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(warmup + steps):
        if step == warmup:
            ddp.tracer.clear()
        opt.zero_grad()
        loss_fn(ddp(*inputs)).backward()
        opt.step()
    ddp.tracer.export_chrome_trace(path)


def record_trace(spec: str, path: str, world_size: int = 1, steps: int = 5, warmup: int = WARMUP_STEPS,
                 **options) -> None:
    """Run ``steps`` traced steps (after ``warmup``) of a model on Gloo, write the Chrome trace to ``path``.

    ``spec``: a ``minddp_lab.models`` name, or ``module:function`` / ``file.py:function`` (module doc).
    ``options``: MiniDDP's keyword options the model needs (``find_unused_parameters=True``...).
    ValueError, in one line, if the builder cannot be found, ``path``'s folder does not exist, or a rank
    raises (its exception's last line, and the command's flag where one would help).
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--out {path}: no folder {folder} to write the trace into")
    if spec not in MODEL_NAMES:
        load_builder(spec)
        where, _, name = spec.rpartition(":")
        if where.endswith(".py"):  # the ranks may start elsewhere: name the file absolutely
            spec = f"{os.path.abspath(where)}:{name}"
    try:
        spawn(_rank, world_size, spec, path, steps, warmup, options, backend="gloo")
    except RankFailed as e:
        raise ValueError(f"--record {spec}: {_last_line(str(e))}{_hint(str(e))}") from None


def _last_line(report: str) -> str:
    """The exception line of a rank's traceback (its last line that is not a note in parentheses)."""
    lines = [x.strip() for x in report.splitlines() if x.strip() and not x.strip().startswith("(")]
    return lines[-1] if lines else report.strip()


def _hint(report: str) -> str:
    for option, flag in (("find_unused_parameters", "--find-unused-parameters"), ("static_graph", "--static-graph")):
        if option in report:
            return f" (the command passes {option}=True with {flag})"
    return ""
