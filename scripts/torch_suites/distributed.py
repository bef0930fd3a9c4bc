"""torch's large DDP suite (``distributed_test.py``, from the installed wheel), run test by test.

torch keeps the suite in ``torch/testing/_internal/distributed/distributed_test.py``
as the methods of ``DistributedTest._DistTestBase``; its CI runs them through a
short file that mixes that class with ``TestDistBackend`` (which starts one
process per rank and joins them with a file store) after setting ``BACKEND``,
``WORLD_SIZE`` and ``TEMP_DIR``. This module does the same in-process: Gloo,
2 ranks, the CPU.

Only the tests whose code reaches ``DistributedDataParallel``,
``SyncBatchNorm`` or ``DistributedSampler`` run (``torch_suites/selection.py``).
The class under test is chosen test by test, just before the test starts (its
ranks are forked, so they inherit the choice): in the ``minddp`` run a test
gets minddp's class for each of the three it reaches and torch's for the
rest; the ``torch`` run (the control) always gets torch's. No shim: a
torch-private method minddp lacks fails the test, and the attempt is recorded
(``torch_suites/classify.py`` reads the record).
"""

from __future__ import annotations

import importlib
import os
import tempfile
import unittest
from pathlib import Path
from typing import Any

import torch

import patches
import selection

MODULE = "torch.testing._internal.distributed.distributed_test"
BASE_CLASS = "_DistTestBase"
TEST_ID_PREFIX = "distributed_test"
WORLD_SIZE = 2
MISSING_LOG_ENV = "TORCH_SUITES_MISSING_LOG"  # a file: "test id<TAB>Class.name" per private name minddp lacked


def set_environment() -> None:
    """What torch's runner expects before the file is imported: backend, world size, a TEMP_DIR with ``barrier``."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(WORLD_SIZE)
    if not os.environ.get("TEMP_DIR"):
        os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="torch_suites_dist_")
    os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)


def _one_device_per_rank(world_size: int, backend: str = "gloo") -> dict[int, list[int]]:
    """``init_multigpu_helper`` for tests moved to the CPU: rank r uses device r (which means the CPU)."""
    return {rank: [rank] for rank in range(world_size)}


def import_suite() -> Any:
    """``distributed_test`` imported after the runner's patches (its decorators are read at import)."""
    set_environment()
    module = importlib.import_module(MODULE)
    patches.retarget_suite_module(module)
    module.init_multigpu_helper = _one_device_per_rank
    return module


def test_class(module: Any) -> type:
    """torch's CI class: the ranks' life cycle (``TestDistBackend``) with the tests (``_DistTestBase``)."""

    class TestDistBackendWithSpawnGLOO(module.TestDistBackend, module.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    TestDistBackendWithSpawnGLOO.__module__ = TEST_ID_PREFIX
    TestDistBackendWithSpawnGLOO.__qualname__ = TestDistBackendWithSpawnGLOO.__name__
    return TestDistBackendWithSpawnGLOO


def reaches(module: Any) -> dict[str, selection.Reach]:
    return selection.reach_of_tests(Path(module.__file__).read_text(), BASE_CLASS)


def collect(module: Any, pattern: str | None = None) -> tuple[list[unittest.TestCase], dict[str, selection.Reach]]:
    """The selected tests (each an instance of :func:`test_class`) and what each one reaches."""
    found = reaches(module)
    cls = test_class(module)
    tests = [cls(name) for name in selection.selected(found)]
    return [t for t in tests if selection.matches(t.id(), pattern)], found


# ------------------------------------------------------------- the class under test, per test
def _record_missing(owner: str, name: str) -> None:
    path = os.environ.get(MISSING_LOG_ENV)
    if path and selection.is_private(name):
        with open(path, "a") as log:
            log.write(f"{os.environ.get(patches.CURRENT_TEST_ENV, '?')}\t{owner}.{name}\n")


class _RecordingType(type):
    """A class whose missing class attributes are recorded (``DistributedDataParallel._x(...)``)."""

    def __getattr__(cls, name: str) -> Any:
        _record_missing(cls.__name__, name)
        raise AttributeError(f"type object {cls.__name__!r} has no attribute {name!r}")


def recording(cls: type) -> type:
    """``cls`` that records every private attribute asked of it (or of its objects) that it does not have.

    It only watches: what ``cls`` has, and every error it raises, are unchanged.
    """

    def __getattr__(self, name: str) -> Any:
        found = getattr(super(watched, self), "__getattr__", None)  # nn.Module's looks in its dicts
        try:
            if found is None:
                raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")
            return found(name)
        except AttributeError:
            _record_missing(cls.__name__, name)
            raise

    meta = type(cls)  # type, or ABCMeta for a torch Joinable such as MiniDDP
    recording_type = _RecordingType if meta is type else type(f"Recording{meta.__name__}", (_RecordingType, meta), {})
    watched = recording_type(cls.__name__, (cls,), {"__getattr__": __getattr__})
    return patches.findable(watched, __name__, f"Recording{cls.__qualname__}")


def _classes(impl: str) -> dict[str, type]:
    import torch.nn.parallel
    import torch.utils.data.distributed

    ddp = torch.nn.parallel.distributed.DistributedDataParallel
    if impl == "torch":
        return {"DistributedDataParallel": patches.cpu_ddp(ddp), "SyncBatchNorm": torch.nn.modules.SyncBatchNorm,
                "DistributedSampler": torch.utils.data.distributed.DistributedSampler}
    import minddp

    return {"DistributedDataParallel": recording(patches.cpu_ddp(minddp.MiniDDP)),
            "SyncBatchNorm": recording(minddp.SyncBatchNorm), "DistributedSampler": recording(minddp.DistributedSampler)}


_TORCH, _MINDDP = {}, {}
_TORCH_HOMES = {  # where a test finds each class by its torch name
    "DistributedDataParallel": lambda: torch.nn.parallel,
    "SyncBatchNorm": lambda: torch.nn,
    "DistributedSampler": lambda: torch.utils.data,
}


def use_classes(module: Any, impl: str, reached: set[str]) -> dict[str, str]:
    """Put the class for each of TARGETS under torch's names: ``impl``'s where the test reaches it, else torch's.

    Returns ``{name: "torch" or "minddp"}``, what the test got.
    """
    if not _TORCH:
        _TORCH.update(_classes("torch"))
    chosen = {}
    for name in selection.TARGETS:
        side = impl if name in reached else "torch"
        if side == "minddp" and not _MINDDP:
            _MINDDP.update(_classes("minddp"))
        cls = (_MINDDP if side == "minddp" else _TORCH)[name]
        chosen[name] = side
        setattr(_TORCH_HOMES[name](), name, cls)
        if hasattr(module, name):  # the file's own ``from ... import`` copy
            setattr(module, name, cls)
    return chosen
