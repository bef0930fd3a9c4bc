"""The network typed is the network simulated: each flag overrides the one figure it names, and nothing else.

A between-node figure given to a preset whose GPUs share NICs reset them to one NIC per GPU
(``--network pcie-eth25 --latency-us 14`` became 8 NICs per node). Here every preset meets every flag.
"""

import pytest

from minddp_lab.simulate.__main__ import network_figures, parse_args
from minddp_lab.simulate.cluster import names, preset_figures
from minddp_lab.simulate.figures import FLAGS
from minddp_lab.simulate.nccl import Cluster
from minddp_lab.simulate.profile import ComputeProfile, Gradient, save_profile
from simulate_cli import run_cli

# One value per flag, and the figure it names (--nominal-bandwidth with --efficiency: the NIC's bandwidth).
FLAG_VALUES = [
    (["--latency-us", "7.5"], "latency_us", 7.5),
    (["--bandwidth", "3GB/s"], "nic_Bps", 3e9),
    (["--nominal-bandwidth", "100Gb/s", "--efficiency", "0.5"], "nic_Bps", 6.25e9),
    (["--gpus-per-node", "4"], "gpus_per_node", 4),
    (["--nics-per-node", "1"], "nics_per_node", 1),
    (["--intra-latency-us", "2.5"], "intra_latency_us", 2.5),
    (["--intra-bandwidth", "77GB/s"], "intra_Bps", 77e9),
    (["--intra-link", "pci"], "intra_kind", "pci"),
]


@pytest.mark.parametrize("preset", names())
@pytest.mark.parametrize("flag, figure, value", FLAG_VALUES, ids=[f[0][0] for f in FLAG_VALUES])
def test_no_flag_changes_a_figure_it_does_not_name(preset, flag, figure, value):
    before = preset_figures(preset)
    after = network_figures(parse_args(["--trace", "t.json", "--network", preset, *flag]))
    assert after.values[figure] == pytest.approx(value) if isinstance(value, float) else after.values[figure] == value
    assert after.origins[figure].startswith("flag")
    for key in FLAGS:
        if key != figure:
            assert after.values.get(key) == before.values.get(key), (preset, flag, key)
            assert after.origins.get(key) == before.origins.get(key), (preset, flag, key)


@pytest.mark.parametrize("preset", names())
@pytest.mark.parametrize("flag, figure, value", FLAG_VALUES, ids=[f[0][0] for f in FLAG_VALUES])
def test_each_combination_builds_or_says_why_in_one_line(preset, flag, figure, value):
    figures = network_figures(parse_args(["--trace", "t.json", "--network", preset, *flag]))
    g, nics = figures.get("gpus_per_node"), figures.get("nics_per_node")
    flat_given_inside = figure.startswith("intra") and g == 1
    flat_made_a_node = figure == "gpus_per_node" and figures.get("intra_Bps") is None
    too_many_nics = nics is not None and nics > g
    if flat_given_inside or flat_made_a_node or too_many_nics:
        with pytest.raises(ValueError) as e:
            figures.build()
        assert "\n" not in str(e.value)
    else:
        net = figures.build()
        if g > 1:
            assert isinstance(net, Cluster) and net.ranks_per_node == g and net.nics_per_node == (nics or g)


def test_a_latency_on_a_preset_whose_gpus_share_one_nic_keeps_the_one_nic():
    preset = preset_figures("pcie-eth25").build()
    typed = network_figures(parse_args(["--trace", "t.json", "--network", "pcie-eth25", "--latency-us", "14"])).build()
    assert typed.nics_per_node == preset.nics_per_node == 1
    assert typed.inter.bandwidth_Bps == pytest.approx(preset.inter.bandwidth_Bps)
    assert typed.nic.alpha_s == pytest.approx(14e-6) and typed.intra == preset.intra


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "p.json"
    save_profile(ComputeProfile(2.0, [Gradient("w", 5.0, 4_000_000)], 1.0), str(path))
    return str(path)



def test_the_network_line_says_where_each_figure_came_from(trace, capsys):
    code, out, _ = run_cli(capsys, "--trace", trace, "--network", "dgx1-v100", "--latency-us", "9", "--world", "16")
    line = next(x for x in out.splitlines() if x.startswith("network:"))
    assert code == 0
    assert "9 us per step (flag --latency-us)" in line and "4 NIC(s) per node (preset dgx1-v100)" in line
    assert "12 GB/s (preset dgx1-v100: 96% of 12.5)" in line


@pytest.mark.parametrize("argv, says", [
    (["--network", "dgx-a100", "--world", "12"], "not a multiple of 8 GPUs per node"),
    (["--network", "dgx-a100", "--gpus-per-node", "1000000"], "no node holds more than"),
    (["--network", "dgx-a100", "--nics-per-node", "16"], "more NICs than GPUs"),
    (["--network", "ib400", "--intra-bandwidth", "100GB/s"], "--intra-bandwidth describes the link inside a node"),
    (["--network", "ib400", "--gpus-per-node", "8"], "needs the link inside a node"),
])
def test_a_network_that_cannot_be_gets_one_line(trace, capsys, argv, says):
    code, out, err = run_cli(capsys, "--trace", trace, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err
