"""A throwaway SLURM cluster on this one machine, for ``make slurm-check`` and for trying things by hand.

Debian's packages (``slurm-wlm``, ``munge``, ``slurmdbd``, ``mariadb-server``; :func:`install`
fetches them with apt-get where they are missing), every daemon started directly in the
background, without systemd and without cgroups, all of its files in one folder:

- ``munged`` with a fresh key and its own socket;
- MariaDB on its own port and folder, and ``slurmdbd`` on it, so that ``sacct`` answers;
- ``slurmctld`` with a ``slurm.conf`` that tracks memory (``SelectTypeParameters=CR_CPU_Memory``,
  the usual setting of a GPU cluster), pre-empts by partition priority with
  ``PreemptMode=REQUEUE``, and sends a job's own ``--signal`` at pre-emption
  (``SlurmctldParameters=preempt_send_user_signal``; ``PreemptParameters=send_user_signal`` from
  SLURM 23.02) only when asked;
- one ``slurmd`` per node (``n1``, ``n2``: two nodes on one host), each with every core of the
  machine and a share of its memory.

Partitions, all over every node: ``batch`` (the default, grace time 0), ``grace`` (grace time
:data:`GRACE_S`), ``urgent``, whose jobs pre-empt the other two's, and ``short``, whose jobs may
run :data:`SHORT_MAX_MIN` minutes (SLURM's default ``EnforcePartLimits=NO``: a longer job is
accepted and pends for ever). Accounting enforces associations
(``AccountingStorageEnforce=associations,limits``): a job of an account SLURM does not know is
refused, and so is one over its association's limits (``sacctmgr``).

Every command of the cluster reads its ``slurm.conf`` through ``SLURM_CONF``
(:meth:`Cluster.env`). ``python -m tools.slurm_cluster`` starts one, prints that line and keeps it
up until Ctrl-C; :func:`running` is the same as a context manager. Either way every daemon is
stopped and the folder removed at the end. Needs root (the daemons run as root here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sweep.run.ranks import free_port

#: Debian's packages of the cluster, and a program of each to tell whether it is installed.
PACKAGES = {
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "munged": "munge",
    "slurmdbd": "slurmdbd",
    "mariadbd": "mariadb-server",
    "mariadb": "mariadb-client",
}
SBIN = ("/usr/sbin", "/usr/bin")
CLUSTER = "gatedattn"
GRACE_S = 60  # the ``grace`` partition's GraceTime
SHORT_MAX_MIN = 5  # the ``short`` partition's MaxTime, minutes
NODE_MEMORY_MB = 4000  # each node's RealMemory: memory is tracked, as on a GPU cluster
DB_USER, DB_PASSWORD = "slurm", "slurm-check"


class ClusterError(RuntimeError):
    """The cluster cannot be installed or started: one line, with the log that says why."""


def program(name: str) -> str | None:
    """The path of one of the cluster's programs, or None when it is not installed."""
    return shutil.which(name) or next(
        (f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None
    )


def missing() -> list[str]:
    """The Debian packages of :data:`PACKAGES` not installed here."""
    return sorted({pkg for prog, pkg in PACKAGES.items() if program(prog) is None})


def install() -> None:
    """Install what :func:`missing` lists with apt-get (root; services are not started: the
    daemons are ours to start).

    Raises:
        ClusterError: not root, or apt-get failed.
    """
    packages = missing()
    if not packages:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"the SLURM check needs root to install {' '.join(packages)} (apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "RUNLEVEL": "1"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            raise ClusterError(f"{' '.join(command[:2])} failed: {' '.join(tail)}")


@dataclass
class Cluster:
    """A running cluster's folder, ports and daemons (see the module docstring)."""

    folder: Path
    nodes: int = 2
    accounting: bool = True
    send_user_signal: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.folder / "etc" / "slurm.conf"

    def env(self) -> dict[str, str]:
        """This process's environment, with the cluster's commands (``sbatch``, ``srun``,
        ``sacct``, ``scontrol``) pointed at it."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def path(self, *parts: str) -> Path:
        p = self.folder.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def log(self, name: str) -> Path:
        return self.path("log", f"{name}.log")

    def start(self) -> Cluster:
        """Start every daemon and wait until each node is idle.

        Raises:
            ClusterError: a daemon did not start (its log named), or a node did not come up.
        """
        self.ports = {k: free_port() for k in ("ctld", "dbd", "mysql", *self.node_names)}
        self._munge()
        if self.accounting:
            self._mariadb()
            self._slurmdbd()
        self._write_slurm_conf()
        self._daemon("slurmctld", [program("slurmctld"), "-D", "-f", str(self.conf)])
        for node in self.node_names:
            self._daemon(f"slurmd-{node}", [program("slurmd"), "-D", "-f", str(self.conf), "-N", node])
        self._wait(self._nodes_idle, 60, "the nodes to come up (sinfo)", "slurmctld")
        return self

    @property
    def node_names(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.nodes)]

    def _daemon(self, name: str, command: list) -> subprocess.Popen:
        sink = open(self.log(name), "a")  # noqa: SIM115 - the daemon's own, closed when it ends
        proc = subprocess.Popen(
            [str(c) for c in command],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,  # a Ctrl-C at the terminal is ours to pass on, in order
        )
        self.procs[name] = proc
        return proc

    def _wait(self, ready, timeout_s: float, what: str, daemon: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise ClusterError(
                    f"{dead[0]} exited {self.procs[dead[0]].returncode}: see {self.log(dead[0])}"
                )
            time.sleep(0.3)
        raise ClusterError(f"timed out after {timeout_s:.0f} s waiting for {what}: see {self.log(daemon)}")

    def _munge(self) -> None:
        key = self.path("munge", "munge.key")
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.path("munge").chmod(0o700)
        socket_path = self.path("munge", "munge.socket")
        self._daemon(
            "munged",
            [
                program("munged"), "-F", "--force", f"--socket={socket_path}", f"--key-file={key}",
                f"--pid-file={self.path('munge', 'munged.pid')}", f"--seed-file={self.path('munge', 'seed')}",
                f"--log-file={self.log('munged-own')}",
            ],
        )  # fmt: skip
        self._wait(socket_path.exists, 20, "munged's socket", "munged")

    def _mariadb(self) -> None:
        data = self.path("mysql", "data")
        done = subprocess.run(
            [program("mariadb-install-db") or "mariadb-install-db", "--no-defaults", f"--datadir={data}",
             "--user=root", "--auth-root-authentication-method=normal", "--skip-test-db"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            self.log("mariadb-install").write_text(done.stdout + done.stderr)
            raise ClusterError(f"mariadb-install-db failed: see {self.log('mariadb-install')}")
        sock = self.path("mysql", "mysqld.sock")
        self._daemon(
            "mariadbd",
            [
                program("mariadbd"), "--no-defaults", f"--datadir={data}", f"--socket={sock}",
                f"--port={self.ports['mysql']}", "--bind-address=127.0.0.1", "--user=root",
                f"--pid-file={self.path('mysql', 'mysqld.pid')}", "--skip-name-resolve",
                "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=16M",
            ],
        )  # fmt: skip
        grant = (
            f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASSWORD}';"
            f"GRANT ALL ON *.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;"
        )
        client = [program("mariadb"), "--no-defaults", f"--socket={sock}", "-uroot"]

        def granted() -> bool:
            return subprocess.run([*client, "-e", grant], capture_output=True).returncode == 0

        self._wait(granted, 60, "MariaDB", "mariadbd")

    def _slurmdbd(self) -> None:
        conf = self.path("etc", "slurmdbd.conf")
        conf.write_text(
            f"AuthType=auth/munge\nAuthInfo=socket={self.path('munge', 'munge.socket')}\n"
            f"DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={self.ports['dbd']}\nSlurmUser=root\n"
            f"PidFile={self.path('run', 'slurmdbd.pid')}\nStorageType=accounting_storage/mysql\n"
            f"StorageHost=127.0.0.1\nStoragePort={self.ports['mysql']}\nStorageLoc=slurm_acct_db\n"
            f"StorageUser={DB_USER}\nStoragePass={DB_PASSWORD}\n"
        )
        conf.chmod(0o600)
        # slurmdbd reads the slurmdbd.conf beside SLURM_CONF's slurm.conf
        self._daemon("slurmdbd", [program("slurmdbd"), "-D"])
        self._wait(lambda: self._listening(self.ports["dbd"]), 60, "slurmdbd", "slurmdbd")

    def _write_slurm_conf(self) -> None:
        cpus = os.cpu_count() or 1
        host = socket.gethostname()
        lines = [
            f"ClusterName={CLUSTER}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.ports['ctld']}",
            "SlurmUser=root\nSlurmdUser=root",
            "AuthType=auth/munge\nCredType=cred/munge",
            f"AuthInfo=socket={self.path('munge', 'munge.socket')}",
            f"StateSaveLocation={self.path('state', 'ctld')}",
            f"SlurmdSpoolDir={self.folder}/spool/%n",
            f"SlurmctldPidFile={self.path('run', 'slurmctld.pid')}",
            f"SlurmdPidFile={self.folder}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={self.log('slurmctld-own')}",
            f"SlurmdLogFile={self.folder}/log/slurmd-%n-own.log",
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none",
            # memory tracked, a default share per CPU: the usual GPU cluster's setting
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU_Memory\nDefMemPerCPU=1000",
            "SlurmdParameters=config_overrides",  # two nodes' CPUs on one machine's cores
            "ReturnToService=2\nMpiDefault=none\nSwitchType=switch/none",
            "SchedulerType=sched/backfill\nSchedulerParameters=sched_interval=2",
            "PreemptType=preempt/partition_prio\nPreemptMode=REQUEUE",
            "JobRequeue=1\nKillWait=10\nMinJobAge=600\nInactiveLimit=0\nMessageTimeout=20",
            "JobAcctGatherType=jobacct_gather/none",
        ]
        if self.send_user_signal:
            lines.append("SlurmctldParameters=preempt_send_user_signal")  # 23.02 on: PreemptParameters
        if self.accounting:
            lines += [
                "AccountingStorageType=accounting_storage/slurmdbd",
                "AccountingStorageHost=localhost",
                f"AccountingStoragePort={self.ports['dbd']}",
                # the munge socket slurmctld and sacct reach slurmdbd with (AuthInfo's is not used)
                f"AccountingStoragePass={self.path('munge', 'munge.socket')}",
                "AccountingStorageEnforce=associations,limits",  # root's own account: made with the cluster
            ]
        for node in self.node_names:
            (self.folder / "spool" / node).mkdir(parents=True, exist_ok=True)
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.ports[node]} "
                f"CPUs={cpus} RealMemory={NODE_MEMORY_MB} State=UNKNOWN"
            )
        every = f"Nodes={','.join(self.node_names)} MaxTime=INFINITE State=UP"
        lines += [
            f"PartitionName=batch {every} Default=YES PriorityTier=1 GraceTime=0",
            f"PartitionName=grace {every} PriorityTier=1 GraceTime={GRACE_S}",
            f"PartitionName=urgent {every} PriorityTier=2 PreemptMode=OFF",
            f"PartitionName=short {every.replace('INFINITE', str(SHORT_MAX_MIN))} PriorityTier=1",
        ]
        self.conf.parent.mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join(lines) + "\n")

    def reconfigure(self, send_user_signal: bool) -> None:
        """Set ``preempt_send_user_signal`` on or off in the running cluster.

        Raises:
            ClusterError: slurmctld refused the new configuration.
        """
        self.send_user_signal = send_user_signal
        self._write_slurm_conf()
        done = subprocess.run(["scontrol", "reconfigure"], env=self.env(), capture_output=True, text=True)
        if done.returncode:
            raise ClusterError(f"scontrol reconfigure failed: {done.stderr.strip()}")
        self._wait(self._nodes_idle, 60, "the nodes after scontrol reconfigure", "slurmctld")

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _nodes_idle(self) -> bool:
        done = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(), capture_output=True, text=True
        )
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return done.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd, slurmctld, slurmdbd, MariaDB, munged)
        and any job process left behind."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(["scancel", "-u", "root"], env=self.env(), capture_output=True, timeout=30)
        slurmds = [n for n in self.procs if n.startswith("slurmd-")]
        order = [*slurmds, "slurmctld", "slurmdbd", "mariadbd", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._end_stray_steps()

    def _end_stray_steps(self) -> None:
        """slurmstepd processes of this cluster's jobs outlive a stopped slurmd: end them."""
        import psutil

        for proc in psutil.process_iter(["name", "environ"]):
            with contextlib.suppress(psutil.Error):
                env = proc.info["environ"] or {}
                job = proc.info["name"] == "slurmstepd" or "SLURM_JOB_ID" in env
                if job and env.get("SLURM_CONF") == str(self.conf):
                    proc.kill()


def interrupt(signum: int, frame: object) -> None:
    """A SIGTERM handler that unwinds as Ctrl-C does (``finally`` blocks stop the cluster)."""
    raise KeyboardInterrupt


@contextlib.contextmanager
def running(
    folder: Path | None = None, nodes: int = 2, accounting: bool = True, send_user_signal: bool = False
) -> Iterator[Cluster]:
    """A started :class:`Cluster` while inside; stopped, and its folder removed (unless given),
    on leaving, whatever happened."""
    own = folder is None
    folder = Path(tempfile.mkdtemp(prefix="slurm-")) if own else folder
    cluster = Cluster(folder, nodes, accounting, send_user_signal)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if own:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.slurm_cluster``: a cluster up until Ctrl-C (or SIGTERM)."""
    doc = __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="python -m tools.slurm_cluster", description=doc)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--no-accounting", action="store_true", help="no slurmdbd (sacct does not answer)")
    parser.add_argument(
        "--send-user-signal", action="store_true", help="SlurmctldParameters=preempt_send_user_signal"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with it ignored (&)
    signal.signal(signal.SIGTERM, interrupt)  # unwinds: every daemon stopped, the folder removed
    try:
        install()
        with running(None, args.nodes, not args.no_accounting, args.send_user_signal) as cluster:
            print(f"SLURM is up ({args.nodes} nodes). In another shell:\n  export SLURM_CONF={cluster.conf}")
            print("Ctrl-C stops it and removes its folder.", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                while all(p.poll() is None for p in cluster.procs.values()):
                    time.sleep(1)
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
