"""Slurm's compact node lists expanded by cluster.node_events, without scontrol or submitit."""

import pytest

from trainflow.cluster.node_events import expand_nodes


@pytest.mark.parametrize(
    ("nodelist", "names"),
    [
        ("", []),
        ("None assigned", []),
        ("tfnode1", ["tfnode1"]),
        ("tfnode[1-2]", ["tfnode1", "tfnode2"]),
        ("gpu[08-10,7],login1", ["gpu08", "gpu09", "gpu10", "gpu7", "login1"]),
        ("a[1-2],b[3]", ["a1", "a2", "b3"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("node-[1-2]-ib", ["node-1-ib", "node-2-ib"]),
    ],
)
def test_a_node_list_expands_as_slurm_writes_it(nodelist: str, names: list[str]) -> None:
    assert expand_nodes(nodelist) == names
