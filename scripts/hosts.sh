#!/usr/bin/env bash
# Hosts joined by real, rate-limited links, on this one machine (needs root and iproute2).
#
#   bash scripts/hosts.sh up 2 --rate 1gbit     # two hosts, every link shaped to 1 Gbit/s
#   bash scripts/hosts.sh down [ID]             # remove them (all, or the network ID that up printed)
#
# Each host is a network namespace with its own address and interface; two are
# joined by one virtual cable, three or four by a Linux bridge in a namespace of
# its own. `up` prints, per host, the command that starts its node, e.g.
#   ip netns exec mddp-h1a2b3c-r0 env GLOO_SOCKET_IFNAME=mh1a2b3cr0 \
#       torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 10.213.57.1 ... SCRIPT.py
# so that torchrun sees a real two-node launch. The machine's own interfaces
# and routes are not touched. The work is done by minddp_lab/links/hosts.py.
#
# Environment variables it reads:
#   PYTHON   the python that has minddp importable (default: python3)
set -euo pipefail
cd "$(dirname "$0")/.."
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -m minddp_lab.links.hosts "$@"
