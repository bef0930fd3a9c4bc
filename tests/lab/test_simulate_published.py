"""The simulator against PyTorch's published DDP table (benchmarks/published_ddp.py): what the docs claim holds.

No model is traced here: the shapes come from benchmarks/published_ddp_profiles.json (committed).
"""

import pathlib

import pytest
from simulate_cli import benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published():
    return benchmark("published_ddp")


@pytest.fixture(scope="module")
def rows(published):
    from minddp_lab.simulate.overheads import OVERHEAD_PRESETS

    return published.compare(published.profiles(), OVERHEAD_PRESETS["nccl-v100"])


def test_the_docs_table_is_the_scripts_output(published, rows):
    from minddp_lab.simulate.overheads import OVERHEAD_PRESETS

    table = published.table(rows, OVERHEAD_PRESETS["nccl-v100"])
    assert table in (ROOT / "docs" / "simulator_checked.md").read_text(), (
        "docs/simulator_checked.md: rerun `python benchmarks/published_ddp.py` and paste its output")


def test_calibration_models_meet_every_target(published, rows):
    for r in rows:
        if r["held_out"]:
            continue
        assert max(abs(e) for e in r["errors"]) <= 0.03, r["model"]
        assert abs(r["cost_predicted"] - r["cost_published"]) <= 0.015, r["model"]
    assert {r["model"] for r in rows if not r["held_out"]} == set(published.CALIBRATION)


def test_one_megabyte_buckets_come_out_slower_as_published_everywhere(rows):
    for r in rows:
        assert all(p < 0 and q < 0 for p, q in zip(r["bucket_published"], r["bucket_predicted"])), r["model"]


def test_the_bare_model_misses_as_the_issue_found(published):
    from minddp_lab.simulate.overheads import NO_OVERHEADS

    bare = published.compare(published.profiles(), NO_OVERHEADS)
    assert all(e < 0 for r in bare for e in r["errors"][1:])  # every multi-GPU step under the published one
    assert all(r["cost_predicted"] < 0.01 for r in bare)  # 16 GPUs almost free
    assert all(q >= 0 for r in bare for q in r["bucket_predicted"])  # 1 MB never slower: the wrong sign
