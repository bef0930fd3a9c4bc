"""benchmarks/validate_stage3.py's arithmetic, on made-up measurements (no processes): the link is fitted back
exactly from half all-reduce times, the root unit gets the compute no block accounts for, every unit's compute
is scaled to the step measured with its collectives made local, and the prediction is the stage-3 replay of
those units."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import validate_stage3  # noqa: E402
from minddp_lab.network import Link, all_gather_time  # noqa: E402
from minddp_lab.simulate.stage3 import Stage3Policy, Unit, simulate_stage3  # noqa: E402

LINK = Link("hand", alpha_s=1e-3, bandwidth_Bps=1e9)


def test_prediction_is_the_replay_of_the_measured_units_on_the_fitted_link():
    raw = {
        "fit_ms": {str(n): 1e3 * all_gather_time(n, 2, LINK) for n in validate_stage3.FIT_SIZES},
        "measured_ms": {"prefetch": [20.0, 25.0, 30.0], "no prefetch": [30.0, 31.0, 40.0]},
        # two rounds: the median of each figure; the whole model is 3 + 6 ms, blocks 1 + 2 ms each
        "profiles": [{"blocks": [(1.0, 2.0), (1.0, 2.0)], "whole": (3.0, 6.0), "optimizer": 4.0}] * 2,
        "unit_numel": [1000, 250_000, 250_000],  # the root first
        # the step without communication took 1.5x what the profiles add up to (9 + 4 / 2 = 11 ms)
        "local_ms": [16.0, 16.5, 17.0],
    }
    result = validate_stage3.predict(raw, 2)
    assert result["alpha_us"] == pytest.approx(1000.0) and result["bandwidth_MBps"] == pytest.approx(1000.0)
    units = [Unit("root", 4000, 4000, 1.5, 3.0), Unit("block 0", 1_000_000, 1_000_000, 1.5, 3.0),
             Unit("block 1", 1_000_000, 1_000_000, 1.5, 3.0)]
    on, off = (row for row in result["rows"])
    for row, prefetch, measured in ((on, True, 25.0), (off, False, 31.0)):
        # as minddp.fsdp: the last block kept gathered into its backward, the root through the step
        policy = Stage3Policy(prefetch=prefetch, overlap=False, keep_last=True, keep_root=True)
        expected = simulate_stage3(units, LINK, 2, 1.5 * 4.0, policy).step_ms
        assert row["shared_ms"] == pytest.approx(expected)
        assert row["shared_error"] == pytest.approx(expected / measured - 1)
        assert row["compute_ms"] == pytest.approx(16.5)
    assert on["overlap_ms"] < off["overlap_ms"]
    assert "| prefetch |" in validate_stage3.table(result, 2, 2)
