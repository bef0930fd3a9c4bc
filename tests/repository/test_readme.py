"""The README's example runs as printed, with MiniDDP and with torch's DDP."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
MINDDP_IMPORT = "from minddp import MiniDDP as DDP"
TORCH_IMPORT = "from torch.nn.parallel import DistributedDataParallel as DDP"


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if MINDDP_IMPORT in b)


@pytest.mark.parametrize("swap", [False, True], ids=["minddp", "torch"])
def test_readme_example_trains_with_either_import(tmp_path, swap):
    code = readme_example()
    if swap:
        code = code.replace(MINDDP_IMPORT, TORCH_IMPORT)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loss = float(re.search(r"loss after 100 steps: ([0-9.]+)", out.stdout).group(1))
    assert loss < 1.0  # the target is a sum of 20 unit normals (variance 20): it did learn
