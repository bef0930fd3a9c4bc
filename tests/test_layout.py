"""The package's shape: the core stands alone."""

import subprocess
import sys

CORE = ["minddp", "minddp.ddp", "minddp.buckets", "minddp.comm_hooks", "minddp.sync", "minddp.join",
        "minddp.replicas", "minddp.trace", "minddp.sampler", "minddp.sync_batchnorm"]
NOT_CORE = ["minddp.train", "minddp.data", "minddp.models", "torchvision"]


def test_core_imports_without_the_trainer_data_or_models():
    code = (
        f"import importlib, sys\nfor m in {CORE!r}: importlib.import_module(m)\n"
        f"print([m for m in {NOT_CORE!r} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
