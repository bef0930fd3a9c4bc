"""The collective model against published all_reduce_perf tables (benchmarks/published_nccl.py)."""

import pathlib

import pytest
from simulate_cli import benchmark

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published():
    return benchmark("published_nccl")


def test_the_docs_tables_are_the_scripts_output(published):
    from minddp_lab.simulate.nccl import LAUNCH_US

    assert published.report(LAUNCH_US) in (ROOT / "docs" / "collectives_checked.md").read_text(), (
        "docs/collectives_checked.md: rerun `python benchmarks/published_nccl.py` and paste its output")


def test_every_held_out_row_above_a_mebibyte_is_within_ten_percent(published):
    from minddp_lab.simulate.nccl import LAUNCH_US

    rows = [(t, n, us) for t in published.tables() if t["set"] == "held out" for n, us in t["rows"] if n > 2**20]
    assert len(rows) >= 6
    for t, n, us in rows:
        assert abs(published.predicted_us(t, n, LAUNCH_US)[0] / us - 1) <= 0.10, (t["name"], n)


def test_the_launch_cost_is_fitted_on_the_fitting_table_only(published):
    from minddp_lab.simulate.nccl import LAUNCH_US

    assert published.fit() == pytest.approx(LAUNCH_US)
    assert [t["set"] for t in published.tables()].count("fit") == 1


def test_held_out_rows_above_a_mebibyte_come_from_two_multi_node_clusters(published):
    """One cluster's rows are not a multi-node validation."""
    clusters = {t["name"] for t in published.tables() if t["set"] == "held out" and t["world"] > published.gpus_per_node(t)
                and any(n > 2**20 for n, _ in t["rows"])}
    assert len(clusters) >= 2, clusters


def test_a_table_measured_with_nccl_algo_ring_is_predicted_as_a_ring(published):
    from minddp_lab.simulate.nccl import LAUNCH_US

    forced = [t for t in published.tables() if t.get("algorithm") == "ring"]
    assert forced
    for t in forced:
        assert all(published.predicted_us(t, n, LAUNCH_US)[1].startswith("ring/") for n, _ in t["rows"])
        assert "--algorithm ring" in published.command(t)
