"""A private one-node SLURM cluster for tests: munged, slurmctld and slurmd in a temporary folder.

Everything the daemons write (config, munge key and socket, state, spool,
logs, pid files) lives under one folder, and they listen on ports picked free
at start, so the cluster neither reads nor disturbs a SLURM already on the
machine. Client commands find it through ``SLURM_CONF`` (see :attr:`env`).
It needs root (slurmd starts job steps as the submitting user) and the Debian
packages ``slurm-wlm`` and ``munge``; :func:`missing_programs` says what is absent.

    cluster = SlurmCluster.start()
    try:
        subprocess.run(["sbatch", ...], env=cluster.env(...))
    finally:
        leftovers = cluster.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

# Debian puts the daemons in /usr/sbin, which a non-login PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
PROGRAMS = ("sbatch", "scancel", "squeue", "sinfo", "scontrol", "slurmctld", "slurmd", "munged")


def which(program: str) -> str | None:
    return shutil.which(program, path=_SEARCH_PATH)


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if which(p) is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CONFIG = """\
ClusterName=minddptest
SlurmctldHost={node}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
# No cgroups: processes are tracked through /proc, tasks are not pinned.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
PlugStackConfig=/dev/null
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
# scancel: SIGKILL 2 s after SIGTERM (default 30 s).
KillWait=2
# Accept the CPU count below even where the machine has fewer cores.
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    def __init__(self, directory: str):
        self.dir = directory
        self.conf = os.path.join(directory, "slurm.conf")
        self.node = socket.gethostname().split(".")[0]
        self.daemons: list[subprocess.Popen] = []

    @classmethod
    def start(cls, cpus: int = 2, timeout: float = 30.0) -> "SlurmCluster":
        # Short and world-readable: munged refuses a socket in a folder others
        # cannot enter, and a Unix socket path must stay under 108 bytes.
        cluster = cls(tempfile.mkdtemp(prefix="minddp-slurm-", dir="/tmp"))
        try:
            cluster._start(max(cpus, os.cpu_count() or 1), timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self, cpus: int, timeout: float) -> None:
        os.chmod(self.dir, 0o755)
        for sub in ("munge", "state", "spool", "log"):
            os.makedirs(os.path.join(self.dir, sub), mode=0o755)
        key = os.path.join(self.dir, "munge", "munge.key")
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(os.urandom(1024))
        with open(self.conf, "w") as f:
            f.write(_CONFIG.format(node=self.node, dir=self.dir, cpus=cpus,
                                   ctld_port=free_port(), slurmd_port=free_port()))
        munge = os.path.join(self.dir, "munge")
        self._daemon("munged", "--foreground", f"--key-file={key}", f"--socket={munge}/munge.socket",
                     f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
                     f"--seed-file={munge}/munged.seed")
        self._wait_for(lambda: os.path.exists(f"{munge}/munge.socket"), timeout, "munged's socket")
        self._daemon("slurmctld", "-D", "-f", self.conf)
        self._daemon("slurmd", "-D", "-f", self.conf, "-N", self.node)
        self._wait_for(self._node_ready, timeout, f"node {self.node} to be idle")

    def _daemon(self, program: str, *args: str) -> None:
        log = open(os.path.join(self.dir, "log", f"{program}.out"), "w")
        self.daemons.append(subprocess.Popen([which(program), *args], stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env()))
        log.close()

    def _node_ready(self) -> bool:
        state = self.run("sinfo", "-h", "-N", "-o", "%t", check=False).stdout.strip()
        return state == "idle"

    def _wait_for(self, ready, timeout: float, what: str, raise_on_timeout: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if not raise_on_timeout and time.monotonic() > deadline:
                return
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args[0]} exited with {daemon.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}\n{self.logs()}")
            time.sleep(0.2)

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for client commands (sbatch, squeue...) and the jobs they start."""
        env = dict(os.environ, SLURM_CONF=self.conf, PATH=_SEARCH_PATH)
        env.update(extra)
        return env

    def run(self, *command: str, check: bool = True, timeout: float = 30, env=None) -> subprocess.CompletedProcess:
        result = subprocess.run([which(command[0]) or command[0], *command[1:]], env=env or self.env(),
                                capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {result.returncode}\n{result.stderr}")
        return result

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, COMPLETED, CANCELLED, FAILED... (the controller keeps ended jobs a while)."""
        out = self.run("scontrol", "show", "job", job_id, "-o", check=False).stdout
        fields = dict(field.split("=", 1) for field in out.split() if "=" in field)
        return fields.get("JobState", "UNKNOWN")

    def wait_job(self, job_id: str, timeout: float) -> str:
        ended = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
        self._wait_for(lambda: self.job_state(job_id) in ended, timeout, f"job {job_id} to end")
        return self.job_state(job_id)

    def logs(self) -> str:
        parts = []
        for folder in ("log", "munge"):
            for name in sorted(os.listdir(os.path.join(self.dir, folder))):
                if name.endswith((".log", ".out")):
                    with open(os.path.join(self.dir, folder, name), errors="replace") as f:
                        parts.append(f"--- {name} (last lines)\n" + "".join(f.readlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons, and return the processes that had to be SIGKILLed.

        A process belongs to the cluster when its command line or environment
        names the cluster's folder: the daemons, slurmstepd (forked by slurmd)
        and every task of a job (whose environment carries SLURM_CONF).
        """
        if all(d.poll() is None for d in self.daemons):
            self.run("scancel", "--full", "--partition=debug", check=False)
            self._wait_for(lambda: not self.run("squeue", "-h", check=False).stdout.strip(), 15,
                           "cancelled jobs to end", raise_on_timeout=False)
        for daemon in reversed(self.daemons):  # slurmd, slurmctld, then munged
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        leftovers = self._processes()
        for pid, command in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.wait(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)
        return [f"{pid} {command}" for pid, command in leftovers]

    def _processes(self) -> list[tuple[int, str]]:
        mine = {os.getpid()}
        marker = self.dir.encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in mine:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environment = f.read()
            except OSError:  # gone already, or a kernel thread
                continue
            if command and (marker in command or marker in environment):
                found.append((int(entry), command.replace(b"\0", b" ").decode(errors="replace").strip()))
        return found
