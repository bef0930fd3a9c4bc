"""For the simulator's tests: ``python -m minddp_lab.simulate`` in-process, and a benchmark script as a module."""

import importlib.util
import pathlib
import sys

from minddp_lab.simulate.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def benchmark(name: str):
    """``benchmarks/<name>.py`` imported as a module (the benchmarks folder is not a package)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))  # where `python benchmarks/<name>.py` finds benchlib
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
