"""The rule that places a restart after lost ranks (cluster.restarts.next_placement), without
Slurm: the node lists are what usable_nodes reads from a 2- or 3-node partition."""

from functools import partial

import pytest

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.restarts import Placement, next_placement, usable_nodes

TWO = ["tfnode1", "tfnode2"]
THREE = ["tfnode1", "tfnode2", "tfnode3"]


def test_a_node_to_spare_keeps_the_size_and_excludes_the_lost_node() -> None:
    placed = next_placement(2, 2, frozenset(), {"tfnode2"}, THREE, elastic=False)
    assert placed == Placement(2, frozenset({"tfnode2"}), "excluding node(s) tfnode2")


def test_an_fsdp_job_continues_on_the_nodes_left_when_none_is_spare() -> None:
    placed = next_placement(2, 2, frozenset(), {"tfnode2"}, TWO, elastic=True)
    assert (placed.nodes, placed.excluded) == (1, frozenset({"tfnode2"}))
    assert placed.where == (
        "excluding node(s) tfnode2, on 1 of the 1 node(s) left (2 ranks: the sharded "
        "checkpoint reshards)"
    )


def test_a_ddp_job_with_no_spare_node_runs_again_anywhere_at_its_size() -> None:
    placed = next_placement(2, 2, frozenset(), {"tfnode2"}, TWO, elastic=False)
    assert (placed.nodes, placed.excluded) == (2, frozenset())
    assert placed.where.startswith("on any node")


def test_losing_every_node_leaves_nothing_to_continue_on() -> None:
    placed = next_placement(2, 2, frozenset(), set(TWO), TWO, elastic=True)
    assert (placed.nodes, placed.excluded) == (2, frozenset())


def test_fewer_nodes_are_as_many_as_divide_the_first_size_so_the_global_batch_is_kept() -> None:
    four = [*THREE, "tfnode4"]
    first = next_placement(4, 2, frozenset(), {"tfnode4"}, four, elastic=True)
    assert (first.nodes, first.excluded) == (2, frozenset({"tfnode4"}))
    assert "on 2 of the 3 node(s) left (4 ranks:" in first.where
    three = next_placement(3, 2, frozenset(), {"tfnode3"}, THREE, elastic=True)
    assert three.nodes == 1  # 2 of 3 ranks' worth cannot make up the global batch


def test_a_second_loss_shrinks_again_and_keeps_the_first_exclusion() -> None:
    four = [*THREE, "tfnode4"]
    first = next_placement(4, 4, frozenset(), {"tfnode4"}, four, elastic=True)
    assert (first.nodes, first.excluded) == (2, frozenset({"tfnode4"}))
    second = next_placement(first.nodes, 4, first.excluded, {"tfnode2"}, four, True, 4)
    assert (second.nodes, second.excluded) == (2, frozenset({"tfnode2", "tfnode4"}))
    third = next_placement(second.nodes, 4, second.excluded, {"tfnode3"}, four, True, 4)
    assert (third.nodes, third.excluded) == (1, frozenset({"tfnode2", "tfnode3", "tfnode4"}))
    assert "on 1 of the 1 node(s) left (4 ranks:" in third.where


def test_the_local_executor_places_nothing() -> None:
    cfg = ClusterConfig(executor="local")
    assert usable_nodes(cfg) is None
    placed = next_placement(1, 2, frozenset(), {"vm"}, usable_nodes(cfg), elastic=True)
    assert (placed.nodes, placed.excluded) == (1, frozenset())


def test_an_allocation_offers_its_own_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "tfnode[1-2]")
    usable = usable_nodes(ClusterConfig(executor="allocation", nodes=2))
    assert usable == TWO
    placed = next_placement(2, 2, frozenset(), {"tfnode1"}, usable, elastic=True)
    assert (placed.nodes, placed.excluded) == (1, frozenset({"tfnode1"}))


def test_a_mesh_continues_on_fewer_nodes_only_where_its_sizes_make_them_up() -> None:
    """tp=2 with dp_shard the rest: 2 nodes x 2 ranks lose one, 1 node x 2 ranks is tp=2 x
    dp_shard=1. dp_shard=2 fixed: 2 ranks cannot make up 2 x 2, so the job stays at its size."""
    from trainflow.tasks.train.config import TrainConfig
    from trainflow.tasks.train.task import admits

    rest = TrainConfig(strategy="fsdp", parallel={"tp": 2})
    placed = next_placement(2, 2, frozenset(), {"tfnode2"}, TWO, partial(admits, rest))
    assert (placed.nodes, placed.excluded) == (1, frozenset({"tfnode2"}))
    fixed = TrainConfig(strategy="fsdp", parallel={"tp": 2, "dp_shard": 2})
    placed = next_placement(2, 2, frozenset(), {"tfnode2"}, TWO, partial(admits, fixed))
    assert (placed.nodes, placed.excluded) == (2, frozenset())
    assert placed.where == (
        "on any node (the others cannot hold the job alone and train.parallel makes up no "
        "fewer ranks than 4)"
    )
    assert not admits(TrainConfig(), 2)  # ddp: its checkpoints are for the ranks they had
