"""Renders the dev Slurm cluster's configs (slurm.conf, slurmdbd.conf, gres.conf, hosts line).

cluster/dev/slurm.sh starts and stops the daemons; what they read is written here, from one
typed description of the cluster, so the layout (how many nodes, their ports, CPUs, memory and
fake GPUs) is code that can be read and tested, not text assembled by sed. Stdlib only: the
script runs this with whatever Python it finds, before any virtualenv exists.

    python cluster/dev/slurm_config.py write --base DIR --port P --nodes N --hw "$(slurmd -C)"

writes the files that changed under DIR/etc, prints `changed` or `unchanged`, then one line per
node: `<name> <port>`. Why each setting is there: /work/shared/notes/slurm.md.
"""

import argparse
import os
import re
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLUSTER = "trainflow"
PARTITION = "debug"
NODE_PREFIX = "tfnode"
"""Node names are tfnode1..tfnodeN; a hosts line makes them resolve to 127.0.0.1, since ranks
rendezvous at the job's first node by name."""
TOTAL_CPUS = 8
"""Fake cores shared out between the nodes: more than the machine has, so several 1-CPU jobs
run at once (SlurmdParameters=config_overrides lets a node claim them)."""
GPUS_PER_NODE = 2
"""Fake GPUs per node (files linked to /dev/null): enough to test GPU requests and binding."""
HOSTS_MARK = "# trainflow dev slurm nodes"
MAX_NODES = 8


@dataclass(frozen=True)
class DevCluster:
    """Where the dev cluster lives and how it is laid out."""

    base: Path
    """Folder holding configs (etc/), logs (log/), pid files (run/), spool and database."""
    port: int
    """slurmctld's port; slurmdbd uses port+2, MariaDB port+3, node k (1-based) port+3+k."""
    nodes: int
    """Number of emulated nodes, one slurmd each."""
    real_memory_mb: int
    """The machine's memory as `slurmd -C` reports it (RealMemory)."""
    host: str
    """Short hostname of this machine (slurmctld's host)."""

    @property
    def node_names(self) -> list[str]:
        """tfnode1..tfnodeN."""
        return [f"{NODE_PREFIX}{k}" for k in range(1, self.nodes + 1)]

    def node_port(self, k: int) -> int:
        """slurmd's port of node k (1-based)."""
        return self.port + 3 + k

    @property
    def cpus_per_node(self) -> int:
        """TOTAL_CPUS shared out, at least 2 per node (a 2-rank job fits on one node)."""
        return max(2, TOTAL_CPUS // self.nodes)

    @property
    def memory_per_node_mb(self) -> int:
        """The machine's memory shared out, with 10% spare: a node that reports less memory
        than configured is drained."""
        return (self.real_memory_mb - self.real_memory_mb // 10) // self.nodes

    @property
    def munge_socket(self) -> Path:
        """munged's socket of this cluster (apart from any system munged)."""
        return self.base / "munge" / "munge.socket"


def slurm_conf(c: DevCluster) -> str:
    """slurm.conf: controller, accounting and one NodeName line per node."""
    log, run, spool = (c.base / d for d in ("log", "run", "spool"))
    nodes = [
        f"NodeName={name} NodeHostname={c.host} NodeAddr=127.0.0.1 Port={c.node_port(k)} "
        f"CPUs={c.cpus_per_node} Boards=1 SocketsPerBoard=1 CoresPerSocket={c.cpus_per_node} "
        f"ThreadsPerCore=1 RealMemory={c.memory_per_node_mb} Gres=gpu:{GPUS_PER_NODE} "
        "State=UNKNOWN"
        for k, name in enumerate(c.node_names, start=1)
    ]
    lines = [
        "# Written by trainflow cluster/dev/slurm_config.py; rewritten on every 'up'.",
        f"ClusterName={CLUSTER}",
        f"SlurmctldHost={c.host}(127.0.0.1)",
        f"SlurmctldPort={c.port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire=10: a requeued job is eligible again after 11 s instead of 121 s.
        f"AuthInfo=socket={c.munge_socket},cred_expire=10",
        f"StateSaveLocation={spool}/slurmctld",
        # %n: one spool, pid file and log per node, so N slurmd share this machine.
        f"SlurmdSpoolDir={spool}/slurmd-%n",
        f"SlurmctldPidFile={run}/slurmctld.pid",
        f"SlurmdPidFile={run}/slurmd-%n.pid",
        f"SlurmctldLogFile={log}/slurmctld.log",
        f"SlurmdLogFile={log}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroups in this sandbox: with cgroup plugins every step fails and the node drains.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        # CR_Core, not CR_Core_Memory: without DefMemPerCPU every job would take a whole node.
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=127.0.0.1",
        f"AccountingStoragePort={c.port + 2}",
        # For connections to slurmdbd this names the munge socket (AuthInfo is not used there).
        f"AccountingStoragePass={c.munge_socket}",
        "AccountingStorageTRES=gres/gpu",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        # submitit's job process ignores SIGTERM: without this a cancel lingers 30 s.
        "KillWait=5",
        "MinJobAge=600",
        "JobRequeue=1",
        "ReturnToService=2",
        "MailProg=/bin/true",
        # scrontab (deploy/slurm/scrontab.example): cron lines that Slurm itself queues as jobs.
        "ScronParameters=enable",
        "GresTypes=gpu",
        "SlurmdParameters=config_overrides",
        *nodes,
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "PartitionName=short Nodes=ALL MaxTime=30 State=UP",
    ]
    return "\n".join(lines) + "\n"


def slurmdbd_conf(c: DevCluster) -> str:
    """slurmdbd.conf: accounting into the cluster's own MariaDB on loopback."""
    lines = [
        "# Written by trainflow cluster/dev/slurm_config.py; rewritten on every 'up'.",
        "AuthType=auth/munge",
        f"AuthInfo=socket={c.munge_socket}",
        "DbdHost=localhost",
        "DbdAddr=127.0.0.1",
        f"DbdPort={c.port + 2}",
        "SlurmUser=root",
        f"PidFile={c.base}/run/slurmdbd.pid",
        f"LogFile={c.base}/log/slurmdbd.log",
        "DebugLevel=info",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={c.port + 3}",
        "StorageUser=root",
        "StorageLoc=slurm_acct_db",
    ]
    return "\n".join(lines) + "\n"


def gres_conf(c: DevCluster) -> str:
    """gres.conf: the fake GPU files of every node (a Count-only line makes a node INVAL)."""
    return f"Name=gpu File={c.base}/fakedev/nvidia[0-{GPUS_PER_NODE - 1}]\n"


def hosts_line(c: DevCluster) -> str:
    """The /etc/hosts line that makes every node name resolve to loopback."""
    return f"127.0.0.1 {' '.join(c.node_names)} {HOSTS_MARK}"


def with_hosts_line(hosts: str, line: str) -> str:
    """`hosts` (the text of /etc/hosts) with one marked line naming the nodes of `line` and of
    the marked line already there: a second dev cluster (its own base folder and ports) may
    run beside the first, and a name that resolves to loopback harms no one."""
    entries = hosts.splitlines()
    ours = [entry for entry in entries if entry.endswith(HOSTS_MARK)]
    kept = [entry for entry in entries if not entry.endswith(HOSTS_MARK)]
    names = {name for entry in [*ours, line] for name in _names(entry)}
    merged = f"127.0.0.1 {' '.join(sorted(names, key=_natural))} {HOSTS_MARK}"
    return "\n".join([*kept, merged]) + "\n"


def _names(entry: str) -> list[str]:
    """The host names of a marked hosts line."""
    return entry.removesuffix(HOSTS_MARK).split()[1:]


def _natural(name: str) -> tuple[str, int]:
    """Sort key: tfnode2 before tfnode10."""
    stem = name.rstrip("0123456789")
    return stem, int(name[len(stem) :] or 0)


def _put(path: Path, content: str, mode: int) -> bool:
    """Write `content` to `path` atomically when it differs; True when it changed."""
    if path.is_file() and path.read_text() == content:
        return False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(content)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def write(c: DevCluster) -> bool:
    """Write every config under base/etc; True when one of them changed (daemons restart)."""
    etc = c.base / "etc"
    etc.mkdir(parents=True, exist_ok=True)
    changed = _put(etc / "slurm.conf", slurm_conf(c), 0o644)
    # slurmdbd refuses a config readable by others or not owned by its SlurmUser (root).
    changed |= _put(etc / "slurmdbd.conf", slurmdbd_conf(c), 0o600)
    changed |= _put(etc / "gres.conf", gres_conf(c), 0o644)
    _put(etc / "port", f"{c.port}\n", 0o644)
    _put(etc / "nodes", f"{c.nodes}\n", 0o644)
    return changed


def write_hosts(c: DevCluster, hosts: Path = Path("/etc/hosts")) -> None:
    """Put our line into `hosts` in place (a container's /etc/hosts is often a bind mount,
    which cannot be replaced by a rename)."""
    text = hosts.read_text() if hosts.exists() else ""
    new = with_hosts_line(text, hosts_line(c))
    if new != text:
        with hosts.open("w") as f:
            f.write(new)


def real_memory(hw_line: str) -> int:
    """RealMemory from `slurmd -C`'s node line."""
    found = re.search(r"RealMemory=(\d+)", hw_line)
    if not found:
        raise SystemExit(f"slurmd -C printed no RealMemory: {hw_line!r}")
    return int(found.group(1))


def main(argv: list[str] | None = None) -> int:
    """Command line used by slurm.sh (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="slurm_config")
    parser.add_argument("action", choices=["write", "names"])
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--hw", default="RealMemory=0", help="the node line of `slurmd -C`")
    parser.add_argument("--hosts", type=Path, default=Path("/etc/hosts"))
    args = parser.parse_args(argv)
    if not 1 <= args.nodes <= MAX_NODES:
        print(f"--nodes {args.nodes}: give 1 to {MAX_NODES}", file=sys.stderr)
        return 2
    host = socket.gethostname().split(".")[0]
    c = DevCluster(args.base, args.port, args.nodes, real_memory(args.hw), host)
    if args.action == "write":
        print("changed" if write(c) else "unchanged")
        write_hosts(c, args.hosts)
    for k, name in enumerate(c.node_names, start=1):
        print(name, c.node_port(k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
