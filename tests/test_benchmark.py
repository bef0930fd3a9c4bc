"""benchmarks/compare.py --quick runs end to end and writes the promised JSON.

A smoke test: it checks that every field is there and that MiniDDP and
torch's DDP end the run with the same parameters. It asserts nothing about
timings (those depend on the machine and its load).
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE = os.path.join(ROOT, "benchmarks", "compare.py")

RESULT_FIELDS = {
    "model", "backend", "device", "world_size", "bucket_cap_mb",
    "local_ms", "allreduce_ms", "ideal_ms", "naive_ms", "torch_ddp_ms", "minddp_ms",
    "ratio", "hidden_fraction_torch", "hidden_fraction_minddp",
    "peak_mem_torch_mb", "peak_mem_minddp_mb", "max_param_diff",
}  # fmt: skip


@pytest.mark.timeout(330)
def test_quick_run_writes_every_field_and_the_wrappers_agree(tmp_path):
    out = tmp_path / "quick.json"
    proc = subprocess.run(
        [sys.executable, COMPARE, "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"compare.py --quick failed:\n{proc.stdout}\n{proc.stderr}"
    assert "| model" in proc.stdout  # the table was printed

    data = json.loads(out.read_text())
    assert set(data) == {"config", "results"}
    assert data["config"]["quick"] is True
    results = data["results"]
    assert {r["model"] for r in results} == {"mlp", "cnn", "ae"}
    for r in results:
        assert set(r) == RESULT_FIELDS, f"fields differ: {set(r) ^ RESULT_FIELDS}"
        assert (r["backend"], r["device"], r["world_size"]) == ("gloo", "cpu", 2)
        for key in RESULT_FIELDS - {"model", "backend", "device"}:
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r[key])
        assert r["ideal_ms"] == max(r["local_ms"], r["allreduce_ms"])
        assert 0.0 <= r["hidden_fraction_torch"] <= 1.0
        assert 0.0 <= r["hidden_fraction_minddp"] <= 1.0
        assert r["max_param_diff"] <= 1e-5, f"{r['model']}: MiniDDP and torch's DDP diverged by {r['max_param_diff']}"


def test_plot_without_matplotlib_says_how_to_install(tmp_path):
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed; the hint only shows without it")
    except ImportError:
        pass
    proc = subprocess.run(
        [sys.executable, COMPARE, "--quick", "--plot", str(tmp_path / "x.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "pip install" in proc.stderr and "plot" in proc.stderr
