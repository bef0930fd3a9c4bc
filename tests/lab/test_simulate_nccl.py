"""All-reduce as NCCL runs it (minddp_lab.simulate.nccl), and the ``collective`` subcommand that prints it.

Hand computations with NCCL's own constants (tuning.cc), on a made-up cluster with round figures.
"""

import pytest

from minddp_lab.network import Link, hierarchical_allreduce_time
from simulate_cli import run_cli
from minddp_lab.simulate.collective_report import size_range
from minddp_lab.simulate.nccl import BASE_LATENCY_US, HOP_LATENCY_US, Cluster, nccl_time

GB = 1e9
# 8 GPUs per node at 200 GB/s inside (3.4 us a step, NVLink), 4 NICs of 24 GB/s (9.6 us a step), no launch cost
CLUSTER = Cluster("hand", Link("inside", 3.4e-6, 200 * GB), Link("share", 9.6e-6, 12 * GB), 8, nics_per_node=4,
                  nic=Link("NIC", 9.6e-6, 24 * GB), launch_us=0.0)


def test_one_node_simple_ring_by_hand():
    n, p = 256e6, 8
    c = nccl_time("all_reduce", n, p, CLUSTER, "ring", "Simple")
    latency = BASE_LATENCY_US["ring", "Simple"] + 14 * 3.4
    assert c.seconds == pytest.approx(latency * 1e-6 + n / (200 * GB * p / 14))


def test_across_nodes_the_ring_runs_at_its_slowest_hop_not_the_sum_of_phases():
    n, p = 1e9, 24  # 3 nodes: the NICs (4 x 24 = 96 GB/s a node) are the slowest hop
    c = nccl_time("all_reduce", n, p, CLUSTER, "ring", "Simple")
    latency = BASE_LATENCY_US["ring", "Simple"] + (46 - 4) * 3.4 + 4 * 9.6
    assert c.seconds == pytest.approx(latency * 1e-6 + n / (96 * GB * p / 46))
    busbw = n / c.seconds * 46 / 24
    assert 90 * GB < busbw < 96 * GB  # close to the NICs' line: pipelined
    phases = hierarchical_allreduce_time(n, p, CLUSTER)  # inside, then between, then inside again
    assert phases > 1.1 * c.seconds


def test_small_messages_take_ll_and_its_own_latencies():
    c = nccl_time("all_reduce", 8, 8, CLUSTER)
    assert (c.algorithm, c.protocol) == ("ring", "LL")
    hop = 3.4 * HOP_LATENCY_US["nvlink", "ring"][0] / HOP_LATENCY_US["nvlink", "ring"][2]
    assert c.seconds == pytest.approx((BASE_LATENCY_US["ring", "LL"] + 14 * hop) * 1e-6 + 8 / (50 * GB * 8 / 14))
    assert nccl_time("all_reduce", 1e9, 8, CLUSTER).protocol == "Simple"


def test_many_nodes_take_the_tree_for_small_messages_and_the_ring_for_large():
    assert nccl_time("all_reduce", 4096, 8 * 64, CLUSTER).algorithm == "tree"
    assert nccl_time("all_reduce", 8e9, 8 * 64, CLUSTER).algorithm == "ring"


def test_a_forced_algorithm_or_protocol_is_obeyed():
    c = nccl_time("all_reduce", 1e6, 16, CLUSTER, "tree", "Simple")
    assert (c.algorithm, c.protocol) == ("tree", "Simple")
    with pytest.raises(ValueError, match="ring only"):
        nccl_time("reduce_scatter", 1e6, 16, CLUSTER, "tree")


def test_sizes_like_nccl_tests():
    assert size_range("8:64", 2) == [8, 16, 32, 64]
    assert size_range("1K:4K", 2) == [1024, 2048, 4096]
    assert size_range("1G", 2) == [2**30]



def test_collective_prints_nccl_tests_columns(capsys):
    code, out, _ = run_cli(capsys, "collective", "all_reduce", "--bytes", "1M:4M", "--world", "16", "--network", "dgx-a100")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line and not line.startswith("#")]
    assert [int(r[0]) for r in rows] == [2**20, 2**21, 2**22]
    for size, count, kind, op, time_us, algbw, busbw, how in rows:
        assert int(count) == int(size) // 4 and (kind, op) == ("float", "sum")
        assert float(algbw) == pytest.approx(int(size) / float(time_us) / 1e3, abs=0.01)
        assert float(busbw) == pytest.approx(float(algbw) * 2 * 15 / 16, abs=0.02)
        assert "/" in how


def test_collective_against_a_measured_table_prints_each_rows_error(tmp_path, capsys):
    table = tmp_path / "measured.txt"
    table.write_text("#  Rank  0 Group 0\n#  Rank  1 Group 0\n"
                     "     4194304   1048576  float  sum  -1  100.0  41.94  41.94  0  100.0  41.94  41.94  0\n")
    code, out, _ = run_cli(capsys, "collective", "all_reduce", "--against", str(table), "--network", "dgx-a100")
    row = [line for line in out.splitlines() if line.strip().startswith("4194304")][0]
    predicted, measured, error = float(row.split()[4]), float(row.split()[-2]), row.split()[-1]
    assert code == 0 and measured == 100.0 and error == f"{(predicted - 100) / 100:+.1%}"
    assert "2 ranks" in out and "worst error" in out


@pytest.mark.parametrize("argv, says", [
    (["--bytes", "-8:1G"], "--bytes"),
    (["--bytes", "8:10000T"], "--bytes"),
    (["--bytes", "1G:8"], "largest size is under the smallest"),
    (["--world", "12"], "not a multiple of 8"),
    (["--factor", "1"], "--factor"),
    (["--network", "ib400", "--protocol", "LL"], "--protocol needs a cluster"),
    (["--gpus-per-node", "1"], "more NICs than GPUs"),
])
def test_collective_bad_input_is_one_line(capsys, argv, says):
    code, out, err = run_cli(capsys, "collective", "all_reduce", "--network", "dgx-a100", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err and not out, err


def test_a_machine_with_one_gpu_per_node_is_still_a_cluster(capsys):
    code, out, _ = run_cli(capsys, "collective", "all_reduce", "--network", "dgx-a100", "--gpus-per-node", "1",
                           "--nics-per-node", "1", "--world", "4", "--bytes", "1G")
    assert code == 0 and "4 node(s) x 1 GPU(s)" in out and "NCCL" in out and "/Simple" in out
