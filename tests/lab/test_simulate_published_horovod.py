"""The simulator against Horovod's published scaling: 128 and 512 GPUs (benchmarks/published_horovod.py)."""

import pathlib

import pytest
from simulate_cli import benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published():
    return benchmark("published_horovod")


def test_the_docs_table_is_the_scripts_output(published):
    assert published.table() in (ROOT / "docs" / "simulator_checked.md").read_text(), (
        "docs/simulator_checked.md: rerun `python benchmarks/published_horovod.py` and paste its output")


def test_the_one_fitted_figure_comes_from_the_calibration_curve_only(published, monkeypatch):
    assert published.fit() == pytest.approx(published.FITTED_LATENCY_US)
    moved = {k: (v if k in published.CALIBRATION else tuple(x * 0.5 for x in v)) for k, v in published.PUBLISHED.items()}
    monkeypatch.setattr(published, "PUBLISHED", moved)
    assert published.fit() == pytest.approx(published.FITTED_LATENCY_US)


def test_the_curve_falls_with_the_cluster_as_published(published):
    """VGG-16 loses clearly more from 128 to 512 GPUs than ResNet-101 does, predicted as published."""
    got = published.efficiencies()
    vgg, resnet = got["vgg16"][1], got["resnet101"][1]
    assert vgg[0] - vgg[-1] > 0.05 and vgg[0] - vgg[-1] > 2 * (resnet[0] - resnet[-1])


def test_every_point_is_within_five_points(published):
    for key, (published_eff, predicted) in published.efficiencies().items():
        assert all(abs(b - a) <= published.TARGET_POINTS / 100 for a, b in zip(published_eff, predicted)), key


def test_two_models_are_held_out_beside_the_calibration_one(published):
    held_out = [m for m in published.PUBLISHED if m not in published.CALIBRATION]
    assert len(published.CALIBRATION) == 1 and len(held_out) >= 2, held_out
