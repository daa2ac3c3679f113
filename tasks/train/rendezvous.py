"""Rendezvous of a submitit job's ranks on a port that is free on the first node.

submitit's own recipe (TorchDistributedEnvironment) derives MASTER_PORT from the job id: a
port nobody checked, in a range that overlaps the kernel's ephemeral ports (32768-60999 here)
and the same again when the job is requeued. Any process there that holds that port (a
client connection, a server, a rank of the previous attempt still dying) fails rank 0 with
EADDRINUSE. Instead, rank 0 starts the TCPStore on a port the kernel picks (port 0) and
publishes where it listens in the job's submitit folder, which every rank already reads
(a shared file system on a real cluster, as submitit requires):

    <folder>/<job id>_rendezvous_<restart>.json   {"addr", "port", "nonce"}

The other ranks wait for that file, check the port answers, connect, and check that the
store holds the file's nonce (a file left by an earlier attempt of a requeued job points to
a dead or foreign store: they wait for rank 0's new one). Slurm's SLURM_RESTART_COUNT is in
the name, so a requeued attempt never reads its predecessor's file; under the local executor
(same job id after a requeue) the nonce check does that work. Under the allocation executor
(cluster.srun_executor) every step, a restart included, has a job id of its own, so two
trainings in one Slurm allocation never share a file; there rank 0 publishes its own host name.
"""

import json
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import submitit
import torch.distributed as dist

from trainflow.errors import TrainflowError

NONCE_KEY = "trainflow/rendezvous-nonce"
POLL_S = 0.2
"""How often a waiting rank looks for rank 0's file."""


class RendezvousError(TrainflowError):
    """The ranks of a job could not meet: names the rank, the place and what was missing."""


@dataclass(frozen=True)
class Layout:
    """A rank's place in a submitit job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    """The job's first node: where rank 0 runs and the store listens."""
    file: Path
    """Where rank 0 publishes the store's address for this attempt."""


def submitit_layout() -> Layout | None:
    """This rank's layout when it is a task of a submitit job with several tasks, else None."""
    try:
        env = submitit.JobEnvironment()
    except RuntimeError:
        return None
    if env.num_tasks <= 1:
        return None
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return Layout(
        rank=env.global_rank,
        world_size=env.num_tasks,
        local_rank=env.local_rank,
        local_world_size=env.num_tasks // env.num_nodes,
        master_addr=env.hostnames[0],
        file=Path(env.paths.folder) / f"{env.job_id}_rendezvous_{restart}.json",
    )


def export_env(layout: Layout, port: int | None = None) -> None:
    """Export the layout as torch's RANK / WORLD_SIZE / LOCAL_RANK / ... variables (and
    MASTER_ADDR / MASTER_PORT once the store's port is known), for code that reads them."""
    os.environ |= {
        "RANK": str(layout.rank),
        "WORLD_SIZE": str(layout.world_size),
        "LOCAL_RANK": str(layout.local_rank),
        "LOCAL_WORLD_SIZE": str(layout.local_world_size),
        "MASTER_ADDR": layout.master_addr,
    }
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)


def meet(layout: Layout, timeout: timedelta) -> dist.TCPStore:
    """The job's store: started here on a free port by rank 0, found and joined by the others.

    Raises RendezvousError when rank 0 has not published a live store within `timeout`."""
    if layout.rank == 0:
        return _host(layout, timeout)
    return _join(layout, timeout)


def _host(layout: Layout, timeout: timedelta) -> dist.TCPStore:
    """Start the store on a port the kernel picks and publish it atomically."""
    store = dist.TCPStore(
        layout.master_addr,
        0,
        layout.world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
    )
    nonce = secrets.token_hex(8)
    store.set(NONCE_KEY, nonce)
    tmp = layout.file.with_name(f"{layout.file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"addr": layout.master_addr, "port": store.port, "nonce": nonce}))
    os.chmod(tmp, 0o600)
    os.replace(tmp, layout.file)
    return store


def _join(layout: Layout, timeout: timedelta) -> dist.TCPStore:
    """Wait for rank 0's file, then connect to the live store it names."""
    deadline = time.monotonic() + timeout.total_seconds()
    seen = "no file yet"
    while time.monotonic() < deadline:
        published = _read(layout.file)
        if published is None:
            seen = "no file yet"
        elif not _answers(published["addr"], published["port"]):
            seen = f"{published['addr']}:{published['port']} does not answer"
        else:
            store = _connect(published["addr"], published["port"], layout.world_size)
            if store is not None and _holds(store, published["nonce"]):
                store.set_timeout(timeout)
                return store
            seen = f"{published['addr']}:{published['port']} is not this attempt's store"
        time.sleep(POLL_S)
    raise RendezvousError(
        f"rank {layout.rank} waited {timeout.total_seconds():.0f} s for rank 0 to start the "
        f"job's store on {layout.master_addr} ({layout.file.name}: {seen}); see rank 0's log "
        "for why it did not start (cluster.peer_timeout_s sets this wait)"
    )


def _read(file: Path) -> dict[str, str | int] | None:
    """The published address, or None while rank 0 has not written it (or mid-replace)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not {"addr", "port", "nonce"} <= data.keys():
        return None
    return data


def _answers(addr: object, port: object, timeout_s: float = 2.0) -> bool:
    """True when something accepts TCP connections there (probed quietly: torch's own client
    logs a C++ stack trace for every failed attempt)."""
    try:
        with socket.create_connection((str(addr), int(str(port))), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _connect(addr: object, port: object, world_size: int) -> dist.TCPStore | None:
    """A client of the store there, or None when what answers is no TCPStore."""
    try:
        return dist.TCPStore(
            str(addr),
            int(str(port)),
            world_size,
            is_master=False,
            timeout=timedelta(seconds=5),
        )
    except (RuntimeError, ValueError, dist.DistError):
        return None


def _holds(store: dist.TCPStore, nonce: object) -> bool:
    """True when `store` is the one rank 0 published with `nonce`."""
    try:
        return store.check([NONCE_KEY]) and store.get(NONCE_KEY).decode() == nonce
    except (RuntimeError, dist.DistError):
        return False
