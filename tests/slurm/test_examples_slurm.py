"""The two examples/ projects on the 2-node dev Slurm: one rank on each node, each importing the
user's model from the run's code snapshot (the job runs `code_first` before it builds the model),
the same checks as on the local executor (tests/integration/test_examples.py)."""

from pathlib import Path

import pytest

from tests.integration.test_examples import CASES, check_example, run_example

TWO_NODES = ["cluster.executor=slurm", "cluster.nodes=2", "cluster.ranks_per_node=1"]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_example_trains_on_two_slurm_nodes(tmp_path: Path, name: str) -> None:
    ran = run_example(name, tmp_path, TWO_NODES)
    check_example(name, ran)
    train = ran.kids["train"].data.tags
    assert train["slurm_node_list"] == "tfnode[1-2]", train
    assert train["slurm_state"] == "COMPLETED", train
