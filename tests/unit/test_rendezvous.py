"""Ranks meet on a store rank 0 starts on a free port, never on a file an earlier attempt left.

Real TCPStores in threads of this process: rank 0's host side and rank 1's joining side."""

import json
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from trainflow.tasks.train.rendezvous import Layout, RendezvousError, meet

TIMEOUT = timedelta(seconds=20)


def _layout(tmp_path: Path, rank: int) -> Layout:
    return Layout(
        rank=rank,
        world_size=2,
        local_rank=rank,
        local_world_size=2,
        master_addr="127.0.0.1",
        file=tmp_path / "42_rendezvous_0.json",
    )


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_in_thread(tmp_path: Path) -> tuple[threading.Thread, list[dist.TCPStore]]:
    joined: list[dist.TCPStore] = []
    thread = threading.Thread(target=lambda: joined.append(meet(_layout(tmp_path, 1), TIMEOUT)))
    thread.start()
    return thread, joined


def _stale(tmp_path: Path, port: int) -> None:
    stale = {"addr": "127.0.0.1", "port": port, "nonce": "from-the-last-attempt"}
    _layout(tmp_path, 0).file.write_text(json.dumps(stale))


@pytest.mark.parametrize("left_behind", ["dead port", "another live store"])
def test_a_rank_waits_past_an_earlier_attempts_file_and_joins_rank_0s_store(
    tmp_path: Path, left_behind: str
) -> None:
    other = None
    if left_behind == "dead port":
        _stale(tmp_path, _dead_port())
    else:  # e.g. another job's store now listens on the port the file names
        other = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        _stale(tmp_path, other.port)
    thread, joined = _join_in_thread(tmp_path)
    time.sleep(1.0)  # rank 1 polls the stale file meanwhile
    assert not joined, "rank 1 joined the store an earlier attempt's file names"

    host = meet(_layout(tmp_path, 0), TIMEOUT)
    thread.join(timeout=30)
    assert joined, "rank 1 never found rank 0's store"
    host.set("from-rank-0", "hello")
    assert joined[0].get("from-rank-0") == b"hello"
    assert json.loads(_layout(tmp_path, 0).file.read_text())["port"] == host.port
    assert other is None or other.port != host.port


def test_a_missing_rank_0_ends_the_wait_with_a_message_naming_it(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RendezvousError) as failure:
        meet(_layout(tmp_path, 1), timedelta(seconds=1))
    assert time.monotonic() - start < 10
    message = str(failure.value)
    assert "rank 1 waited 1 s for rank 0" in message
    assert "42_rendezvous_0.json: no file yet" in message
    assert "cluster.peer_timeout_s" in message


def test_meeting_changes_no_environment_variable(tmp_path: Path) -> None:
    # setup_distributed exports the layout; meet() itself must not leak a world of 2 into the
    # process (a later in-process run would then wait for a peer that never comes).
    before = dict(os.environ)
    thread, joined = _join_in_thread(tmp_path)
    host = meet(_layout(tmp_path, 0), TIMEOUT)  # kept: a dropped store closes its port
    thread.join(timeout=30)
    assert joined and host.port == joined[0].port
    assert dict(os.environ) == before
