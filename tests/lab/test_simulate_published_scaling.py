"""The simulator against TensorFlow's published DGX-1 scaling curve (benchmarks/published_scaling.py)."""

import pathlib

import pytest
from simulate_cli import benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published():
    return benchmark("published_scaling")


def test_the_docs_table_is_the_scripts_output(published):
    assert published.table() in (ROOT / "docs" / "simulator_checked.md").read_text(), (
        "docs/simulator_checked.md: rerun `python benchmarks/published_scaling.py` and paste its output")


def test_the_one_fitted_figure_comes_from_the_calibration_rows_only(published, monkeypatch):
    assert published.fit() == pytest.approx(published.FITTED_CROSS_Bps)
    # held-out rows cannot move the fit: change them and fit again
    moved = {k: (v if k in published.CALIBRATION else tuple(x * 0.5 for x in v)) for k, v in published.PUBLISHED.items()}
    monkeypatch.setattr(published, "PUBLISHED", moved)
    assert published.fit() == pytest.approx(published.FITTED_CROSS_Bps)


def test_the_calibration_rows_are_met(published):
    got = published.efficiencies()
    for key in published.CALIBRATION:
        assert all(abs(b - a) <= 0.05 for a, b in zip(*got[key]))
