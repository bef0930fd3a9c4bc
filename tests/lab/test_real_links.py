"""Real links (minddp_lab/links/namespaces.py): set-up, tear-down, bad rates, a crashed rank.

What needs root and iproute2 skips with the one line :func:`links.missing`
prints; every such test lists the namespaces afterwards, so nothing it built
may survive it. Speed is not asserted here (benchmarks/compare.py --link measures it).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from minddp_lab.links import hosts as link_hosts, namespaces as links

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_root = pytest.mark.skipif(links.missing() is not None, reason=str(links.missing()))


def ours() -> set[str]:
    return {n for n in links.list_namespaces() if n.startswith(links.PREFIX)}


def left_by(pid: int) -> set[str]:
    """The namespaces of process ``pid`` still there (other runs, side by side, have their own)."""
    return {n for n in links.list_namespaces() if n.startswith(f"{links.PREFIX}{pid}x")}


def run_script(argv: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, int]:
    """Run a Python script with this checkout importable; its result and its process id."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), proc.pid


def interfaces(namespace: str) -> str:
    return subprocess.run(["ip", "-n", namespace, "-o", "link"], capture_output=True, text=True).stdout


@pytest.mark.parametrize(
    "text, bits",
    [("100mbit", 10**8), ("1gbit", 10**9), ("2.5gbit", 25 * 10**8), ("10Gbit", 10**10), ("250mbit/s", 25 * 10**7)],
)
def test_rates_from_100mbit_to_10gbit_parse(text, bits):
    assert links.parse_rate(text) == bits
    assert links.parse_rate(links.format_rate(bits)) == bits


@pytest.mark.parametrize("text", ["1gbt", "1gb", "fast", "", "50mbit", "20gbit", "1 gbit per second"])
def test_a_rate_that_does_not_parse_gets_one_line_listing_what_is_accepted(text):
    with pytest.raises(links.LinkError) as info:
        links.parse_rate(text)
    message = str(info.value)
    assert "\n" not in message and repr(text) in message
    assert "100mbit" in message and "10gbit" in message and "1gbit" in message


def test_without_root_one_line_says_so_and_nothing_is_built(monkeypatch):
    before = set(links.list_namespaces()) if links.missing() is None else set()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(links.LinkError, match=r"^real links need root .* uid 1000$"):
        links.build_network(2, "1gbit")
    monkeypatch.undo()
    if links.missing() is None:
        assert set(links.list_namespaces()) == before


def test_without_iproute2_one_line_names_the_missing_tools(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(links.shutil, "which", lambda tool: None)
    assert links.missing() == "real links need iproute2's ip and tc, not found on PATH (apt-get install iproute2)"
    with pytest.raises(links.LinkError, match="iproute2"):
        links.build_network(2, "1gbit")


def test_world_sizes_outside_2_to_4_are_refused_before_anything_is_built():
    with pytest.raises(links.LinkError, match="2 to 4 ranks, not 5"):
        links.build_network(5, "1gbit")


@needs_root
def test_two_ranks_get_one_shaped_cable_and_everything_goes_at_the_end():
    with links.shaped_network(2, "250mbit") as net:
        assert set(net.namespaces) <= ours() and net.switch is None
        assert len(set(net.addresses)) == 2 and net.subnet.startswith("10.213.")
        for ns, iface in zip(net.namespaces, net.interfaces):
            assert iface in interfaces(ns)
            qdisc = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", iface], capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "250Mbit" in qdisc
    assert not set(net.all_namespaces()) & set(links.list_namespaces())


@needs_root
def test_four_ranks_meet_at_a_bridge_and_two_networks_side_by_side_do_not_collide():
    with links.shaped_network(4, "1gbit") as a, links.shaped_network(3, "1gbit") as b:
        assert a.switch in ours() and "br0" in interfaces(a.switch)
        assert not set(a.all_namespaces()) & set(b.all_namespaces())
        assert a.subnet != b.subnet
        ping = subprocess.run(["ip", "netns", "exec", a.namespaces[3], "ping", "-c1", "-W2", a.addresses[0]],
                              capture_output=True, text=True)  # fmt: skip
        assert ping.returncode == 0 or "No such file" in ping.stderr, ping.stdout + ping.stderr
    assert not set(a.all_namespaces() + b.all_namespaces()) & set(links.list_namespaces())


@needs_root
def test_an_exception_inside_the_block_still_removes_everything():
    with pytest.raises(ZeroDivisionError):
        with links.shaped_network(3, "1gbit") as net:
            1 / 0
    assert not set(net.all_namespaces()) & set(links.list_namespaces())


HOLDER = textwrap.dedent(
    """
    import signal, sys, time
    from minddp_lab.links import namespaces as links
    # Ctrl-C as a terminal's Python gets it: a suite started in the background (no job control)
    # hands its children SIGINT ignored, and then nothing would interrupt this one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with links.shaped_network(2, "1gbit") as net:
        print(" ".join(net.all_namespaces()), flush=True)
        time.sleep(60)
    """
)


@needs_root
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_remove_the_network(signum):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    names = holder.stdout.readline().split()
    assert names and set(names) <= ours()
    holder.send_signal(signum)
    assert holder.wait(timeout=20) != 0
    assert not set(names) & set(links.list_namespaces())


@needs_root
def test_a_network_left_by_a_killed_run_is_removed_by_the_next_one():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": REPO})  # fmt: skip
    names = holder.stdout.readline().split()
    holder.kill()  # SIGKILL: no chance to clean up
    holder.wait()
    assert set(names) <= set(links.list_namespaces())
    with links.shaped_network(2, "1gbit"):
        assert not set(names) & set(links.list_namespaces())


def _where_am_i(rank, world_size, path):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    with open(f"{path}/{rank}", "w") as f:
        f.write(f"{os.environ['GLOO_SOCKET_IFNAME']} {os.environ['MASTER_ADDR']} {total.item():g}")


@needs_root
def test_spawn_runs_each_rank_in_its_own_namespace_on_the_link(tmp_path):
    from minddp_lab.links import spawn

    spawn(_where_am_i, 2, str(tmp_path), backend="gloo", link="1gbit")
    seen = sorted(p.read_text().split() for p in tmp_path.iterdir())
    assert [s[0][-2:] for s in seen] == ["r0", "r1"]  # each rank its own interface
    assert seen[0][1] == seen[1][1] and seen[0][1].startswith("10.213.")  # rank 0's address
    assert [s[2] for s in seen] == ["3", "3"]
    assert not left_by(os.getpid())


def _rank1_crashes_mid_run(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))
    if rank == 1:
        raise RuntimeError("rank 1 crashed mid-run")
    dist.all_reduce(torch.zeros(1 << 20))  # rank 0 waits on the wire for a peer that is gone
    time.sleep(120)


@needs_root
def test_a_crashed_rank_stops_the_others_names_itself_and_leaves_no_namespace():
    from minddp_lab.links import spawn
    from minddp.launch import RankFailed
    from minddp.launch.processes import GRACE_S

    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed first") as info:
        spawn(_rank1_crashes_mid_run, 3, backend="gloo", link="1gbit")
    assert "rank 1 crashed mid-run" in str(info.value)
    assert time.monotonic() - started < 30 + GRACE_S  # the start, and the grace after the crash, not the sleep
    assert not left_by(os.getpid())
    assert "mddp" not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_a_crashed_rank_script_exits_non_zero_with_the_rank_named(tmp_path):
    if links.missing() is not None:
        pytest.skip(links.missing())
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent(
        """
        import sys
        sys.path.insert(0, %r)
        from test_real_links import _rank1_crashes_mid_run
        from minddp_lab.links import spawn
        if __name__ == "__main__":
            spawn(_rank1_crashes_mid_run, 2, backend="gloo", link="100mbit")
        """ % os.path.dirname(os.path.abspath(__file__))
    ))  # fmt: skip
    done, pid = run_script([str(script)], timeout=60)
    assert done.returncode != 0
    assert "RankFailed: rank 1 failed first" in done.stderr
    assert not left_by(pid)


@needs_root
def test_hosts_up_prints_a_torchrun_command_per_host_and_down_removes_them(capsys):
    net = link_hosts.up(2, "1gbit", 29500)
    try:
        printed = capsys.readouterr().out
        for r in range(2):
            assert f"ip netns exec {net.namespaces[r]} env GLOO_SOCKET_IFNAME={net.interfaces[r]} torchrun" in printed
            assert f"--node-rank {r} --master-addr {net.addresses[0]}" in printed
    finally:
        removed = link_hosts.down(net.run_id)
    assert sorted(removed) == sorted(net.namespaces)
    assert not set(net.namespaces) & set(links.list_namespaces())


def test_hosts_script_with_a_bad_rate_says_what_is_accepted_and_builds_nothing(capsys):
    assert link_hosts.main(["up", "2", "--rate", "1gbt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'1gbt' does not parse" in err and "100mbit" in err


@needs_root
def test_a_failure_half_way_through_the_build_leaves_nothing_behind(monkeypatch):
    before = set(links.list_namespaces())

    def refuse(namespace, device, rate_bits):
        raise links.LinkError(f"tc refused {device}")

    monkeypatch.setattr(links, "_shape", refuse)
    with pytest.raises(links.LinkError, match="tc refused"):
        links.build_network(3, "1gbit")
    assert set(links.list_namespaces()) == before


LESSONS = os.path.join(REPO, "lessons")


@pytest.mark.parametrize("lesson", ["06_async_overlap.py", "07_buckets.py", "17b_auto_buckets.py"])
def test_a_lesson_given_a_real_link_that_does_not_parse_says_what_is_accepted(lesson):
    done, _ = run_script([os.path.join(LESSONS, lesson), "--link", "real:1gbt"], timeout=60)
    assert done.returncode == 2 and "'1gbt' does not parse" in done.stderr and "100mbit" in done.stderr, done.stderr


@needs_root
def test_lesson_06_measures_its_overlap_on_a_real_link_and_leaves_nothing_behind():
    done, pid = run_script([os.path.join(LESSONS, "06_async_overlap.py"), "--link", "real:1gbit"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "link real:1gbit" in done.stdout and "checked: both variants give the full-batch gradients" in done.stdout
    assert not left_by(pid)
