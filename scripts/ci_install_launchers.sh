#!/usr/bin/env bash
# Install the real launchers the launcher tests run under (tests/lab/test_real_launchers.py):
# SLURM (sbatch, slurmctld, slurmd), munge (SLURM's authentication) and OpenMPI's mpirun.
#
#   bash scripts/ci_install_launchers.sh
#
# Debian/Ubuntu only, as root, non-interactive. Where that is impossible it
# prints why and exits 0: the tests then skip and say what is missing.
set -uo pipefail

# A program counts as installed when it is on PATH or in /usr/sbin (where
# Debian puts the daemons, and which a non-login PATH may lack).
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
missing=()
{ have sbatch && have slurmctld && have slurmd; } || missing+=(slurm-wlm)
have munged || missing+=(munge)
have mpirun || missing+=(openmpi-bin)

if [ ${#missing[@]} -eq 0 ]; then
    echo "[launchers] slurm, munge and mpirun are installed"
    exit 0
fi
skip() { echo "[launchers] not installing ${missing[*]}: $1; the real-launcher tests will skip"; exit 0; }
[ "$(id -u)" -eq 0 ] || skip "not root"
command -v apt-get >/dev/null 2>&1 || skip "no apt-get on this machine"

echo "[launchers] installing ${missing[*]} with apt-get"
export DEBIAN_FRONTEND=noninteractive
apt_install() {
    apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >/tmp/minddp-apt.log 2>&1
}
# A fresh image has no package lists: update once, then retry.
if ! apt_install; then
    apt-get update -q </dev/null >/tmp/minddp-apt.log 2>&1 || skip "apt-get update failed (see /tmp/minddp-apt.log)"
    apt_install || skip "apt-get install failed (see /tmp/minddp-apt.log)"
fi
echo "[launchers] installed ${missing[*]}"
