"""``python -m minddp_lab.links.hosts up 2 --rate 1gbit`` / ``down``: real links that outlive the command.

:func:`minddp_lab.links.namespaces.shaped_network` removes its namespaces when its block
ends. To launch by hand, as on a cluster (one ``torchrun`` per "host"), the
network must stay up between two commands: ``up`` builds it and prints, for
each host, the command that starts its node; ``down`` removes it
(``scripts/hosts.sh`` calls this module). These networks' names start with
``mddp-h``; a leftover sweep of :mod:`minddp_lab.links.namespaces` never touches them.
"""

from __future__ import annotations

import argparse
import secrets
import subprocess
import sys

import minddp_lab.links.namespaces as links

HOSTS_PREFIX = links.PREFIX + "h"


def up(world_size: int, rate: str, port: int) -> links.Network:
    net = links.build_network(world_size, rate, run_id="h" + secrets.token_hex(3))
    print(f"network {net.run_id}: {world_size} hosts on {net.subnet}, every link shaped to {links.format_rate(net.rate_bits)}")
    for r, (ns, iface, address) in enumerate(zip(net.namespaces, net.interfaces, net.addresses)):
        print(f"  host {r}: namespace {ns}, interface {iface}, address {address}")
    print("start one node per host (each in its own terminal, or with & at the end):")
    for r in range(world_size):
        print(f"  ip netns exec {net.namespaces[r]} env GLOO_SOCKET_IFNAME={net.interfaces[r]} "
              f"torchrun --nnodes {world_size} --nproc-per-node 1 --node-rank {r} "
              f"--master-addr {net.master_addr} --master-port {port} SCRIPT.py")  # fmt: skip
    print(f"remove it with: scripts/hosts.sh down {net.run_id}")
    return net


def down(run_id: str | None) -> list[str]:
    """Remove the hosts networks (all of them, or the one with this id); return the namespaces removed."""
    names = [n for n in links.list_namespaces() if n.startswith(HOSTS_PREFIX)]
    if run_id is not None:
        names = [n for n in names if n.startswith(f"{links.PREFIX}{run_id}-")]
    for name in names:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/hosts.sh", description="Hosts joined by real, rate-limited links, on this machine.")
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser("up", help="build N hosts (network namespaces) joined by shaped links")
    make.add_argument("hosts", type=int, help=f"how many (2 to {links.MAX_RANKS})")
    make.add_argument("--rate", default="1gbit", help=links.ACCEPTED)
    make.add_argument("--port", type=int, default=29500, help="the master port printed in the commands")
    remove = sub.add_parser("down", help="remove hosts built by up (all, or the network with this id)")
    remove.add_argument("id", nargs="?", default=None)
    args = p.parse_args(argv)
    try:
        if args.command == "up":
            up(args.hosts, args.rate, args.port)
        else:
            removed = down(args.id)
            print(f"removed {len(removed)} namespace(s)" + (f": {', '.join(removed)}" if removed else ""))
    except links.LinkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
