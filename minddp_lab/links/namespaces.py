"""Real network links between ranks on one machine: one network namespace per rank.

On loopback two ranks share one network stack and the CPU that drives it, so
communication can never wait on a wire and nothing of DDP's overlap shows.
Linux can give each rank a network stack of its own on the same machine: a
*network namespace*. This module builds one per rank, joins them with virtual
Ethernet cables (veth pairs: two ranks directly; three or four through a Linux
bridge in a "switch" namespace of its own) and shapes every sending end to a
rate with a token bucket (``tc qdisc ... tbf``). Gloo then speaks real TCP
between separate stacks at that rate, as between the hosts of a small cluster.
There is no added latency: only rate (``netem``, which would add delay, is
often not built into the kernel).

It stays in its own space: the machine's own interfaces, addresses and routes
are never touched (every link is created directly inside the new namespaces),
the addresses come from a private ``/24`` that no interface of the machine or
of any existing namespace uses, and every name carries this run's id, so two
runs side by side do not collide. Everything is removed on normal exit, on an
exception (a crashed rank), on Ctrl-C and on SIGTERM. A run killed with
SIGKILL cannot clean up; the next :func:`build_network` removes what it left
(its namespaces carry its process id, which is then gone).

Needs root and iproute2 (``ip``, ``tc``); without them :func:`missing` says in
one line what is missing, and nothing is built.

    with shaped_network(2, "1gbit") as net:
        net.namespaces  # ['mddp-4242x0-r0', 'mddp-4242x0-r1']
        net.addresses   # ['10.213.57.1', '10.213.57.2']
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass
from typing import Iterator

__all__ = ["LinkError", "Network", "parse_rate", "format_rate", "missing", "build_network", "shaped_network", "enter", "list_namespaces"]

PREFIX = "mddp-"  # every namespace this module makes starts so
MIN_RATE, MAX_RATE = 100_000_000, 10_000_000_000  # bit/s
MAX_RANKS = 4
ACCEPTED = "a number and mbit or gbit, from 100mbit to 10gbit (e.g. 100mbit, 250mbit, 1gbit, 2.5gbit, 10gbit)"
_UNITS = {"mbit": 10**6, "gbit": 10**9}
_networks_made = itertools.count()


class LinkError(RuntimeError):
    """A link could not be built or parsed; the message is one line for the user."""


def parse_rate(text: str) -> int:
    """``"1gbit"`` -> 1_000_000_000 bit/s. Raises :class:`LinkError` listing what is accepted."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(mbit|gbit)(?:/s)?\s*", str(text), re.IGNORECASE)
    if match is None:
        raise LinkError(f"link rate {text!r} does not parse: write {ACCEPTED}")
    bits = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not MIN_RATE <= bits <= MAX_RATE:
        raise LinkError(f"link rate {text!r} is out of range: write {ACCEPTED}")
    return bits


def format_rate(bits: int) -> str:
    """1_000_000_000 -> ``"1gbit"``; 250_000_000 -> ``"250mbit"``."""
    return f"{bits / 1e9:g}gbit" if bits >= 10**9 else f"{bits / 1e6:g}mbit"


def missing() -> str | None:
    """One line saying what this machine lacks for real links, or None when nothing is missing."""
    tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return f"real links need root (network namespaces and tc); this process runs as uid {os.geteuid()}"
    if tools:
        return f"real links need iproute2's {' and '.join(tools)}, not found on PATH (apt-get install iproute2)"
    return None


@dataclass(frozen=True)
class Network:
    """A built network: rank r lives in ``namespaces[r]``, at ``addresses[r]`` on ``interfaces[r]``."""

    run_id: str
    rate_bits: int
    subnet: str
    namespaces: list[str]
    addresses: list[str]
    interfaces: list[str]
    switch: str | None  # the bridge's namespace (3+ ranks), else None

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def seat(self, rank: int) -> "Seat":
        return Seat(self.namespaces[rank], self.interfaces[rank], self.addresses[rank], self.master_addr)

    def all_namespaces(self) -> list[str]:
        return self.namespaces + ([self.switch] if self.switch else [])

    def remove(self) -> None:
        """Delete every namespace of this network (their links go with them). Safe to call twice."""
        _remove_namespaces(self.all_namespaces())


@dataclass(frozen=True)
class Seat:
    """What one rank needs to join its namespace: picklable, handed to the rank's process."""

    namespace: str
    interface: str
    address: str
    master_addr: str


def enter(seat: Seat) -> None:
    """Move this process (its calling thread, and every thread it starts later) into the rank's
    namespace, and tell Gloo which interface to use. Call before the process group starts."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{seat.namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise LinkError(f"cannot enter network namespace {seat.namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = seat.interface
    os.environ["MASTER_ADDR"] = seat.master_addr


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise LinkError(f"`{' '.join(command)}` failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]


def _remove_namespaces(names: list[str]) -> None:
    present = set(list_namespaces())
    for name in names:
        if name in present:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Remove namespaces of earlier runs whose process is gone (killed by SIGKILL); return their names."""
    stale = []
    for name in list_namespaces():
        match = re.fullmatch(re.escape(PREFIX) + r"(\d+)x\d+-\w+", name)
        if match and not _pid_alive(int(match.group(1))):
            stale.append(name)
    _remove_namespaces(stale)
    return stale


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network on an interface or route of this machine or of any namespace."""
    texts = [_run("ip", "-4", "-o", "addr", "show"), _run("ip", "-4", "route", "show")]
    for name in list_namespaces():
        texts.append(subprocess.run(["ip", "-n", name, "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout)
    found = []
    for cidr in re.findall(r"\b(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", "\n".join(texts)):
        with contextlib.suppress(ValueError):
            found.append(ipaddress.ip_network(cidr, strict=False))
    return found


def pick_subnet() -> ipaddress.IPv4Network:
    """A free /24 in 10.213.0.0/16 (random, so that runs side by side rarely even try the same one)."""
    used = _subnets_in_use()
    candidates = list(range(256))
    random.SystemRandom().shuffle(candidates)
    for third in candidates:
        subnet = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise LinkError("no free /24 left in 10.213.0.0/16 for real links")


def _shape(namespace: str, device: str, rate_bits: int) -> None:
    # The bucket must hold a full offloaded packet (64 KiB) and about 1 ms at the rate.
    burst = max(64 * 1024, rate_bits // 8 // 1000)
    _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
         "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "20ms")  # fmt: skip


def build_network(world_size: int, rate: str | int = "1gbit", run_id: str | None = None) -> Network:
    """Build the namespaces, links and shaping for ``world_size`` ranks; on any failure remove what
    was built and raise :class:`LinkError`. The caller removes it (:meth:`Network.remove`)."""
    rate_bits = parse_rate(rate) if isinstance(rate, str) else int(rate)
    if not 2 <= world_size <= MAX_RANKS:
        raise LinkError(f"real links join 2 to {MAX_RANKS} ranks, not {world_size}")
    problem = missing()
    if problem:
        raise LinkError(problem)
    remove_leftovers()
    run_id = run_id or f"{os.getpid()}x{next(_networks_made)}"
    subnet = pick_subnet()
    hosts = list(subnet.hosts())
    net = Network(
        run_id=run_id,
        rate_bits=rate_bits,
        subnet=str(subnet),
        namespaces=[f"{PREFIX}{run_id}-r{r}" for r in range(world_size)],
        addresses=[str(hosts[r]) for r in range(world_size)],
        interfaces=[f"m{run_id}r{r}"[-15:] for r in range(world_size)],  # Linux allows 15 characters
        switch=f"{PREFIX}{run_id}-sw" if world_size > 2 else None,
    )
    try:
        _wire(net)
    except BaseException:
        net.remove()
        raise
    return net


def _wire(net: Network) -> None:
    for name in net.all_namespaces():
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
    if net.switch is None:  # two ranks: one cable, shaped at both ends
        (ns0, ns1), (if0, if1) = net.namespaces, net.interfaces
        _run("ip", "link", "add", if0, "netns", ns0, "type", "veth", "peer", "name", if1, "netns", ns1)
        ends = [(ns0, if0), (ns1, if1)]
    else:  # a switch: each rank's cable ends in a port of the bridge
        _run("ip", "-n", net.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", net.switch, "link", "set", "br0", "up")
        ends = []
        for r, (ns, iface) in enumerate(zip(net.namespaces, net.interfaces)):
            port = f"port{r}"
            _run("ip", "link", "add", iface, "netns", ns, "type", "veth", "peer", "name", port, "netns", net.switch)
            _run("ip", "-n", net.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", net.switch, "link", "set", port, "up")
            ends += [(ns, iface), (net.switch, port)]  # the rank sends at the rate, and receives at it
    prefix = net.subnet.split("/")[1]
    for ns, iface, address in zip(net.namespaces, net.interfaces, net.addresses):
        _run("ip", "-n", ns, "addr", "add", f"{address}/{prefix}", "dev", iface)
        _run("ip", "-n", ns, "link", "set", iface, "up")
    for ns, device in ends:
        _shape(ns, device, net.rate_bits)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Within the block SIGTERM raises SystemExit (so ``finally`` clauses run), as Ctrl-C raises
    KeyboardInterrupt. Only the main thread may set handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def shaped_network(world_size: int, rate: str | int = "1gbit") -> Iterator[Network]:
    """``with shaped_network(4, "1gbit") as net:`` -- the network of :func:`build_network`, removed
    on leaving the block however it is left (return, exception, Ctrl-C, SIGTERM)."""
    with _sigterm_raises():
        net = build_network(world_size, rate)
        try:
            yield net
        finally:
            net.remove()
