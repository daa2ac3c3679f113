"""The examples/ projects that bring their own code, on the 2-node dev Slurm: one rank on each
node, each importing the user's model from the run's code snapshot (the job runs `code_first`
before it builds the model), the same checks as on the local executor
(tests/integration/test_examples.py). hf_finetune brings no code (a built-in source and model):
what Slurm adds to it, a Hugging Face model fine-tuned on two nodes from a folder named relative
to the command's working folder, is tests/slurm/test_hf_slurm.py's.

Each rank's log names the file its model factory was imported from; the ranks start in the
example's folder (the command's working directory), where the same module lies, so a rank
that skipped the snapshot would name the example's own file."""

import re
from pathlib import Path

import pytest

from tests.integration.test_examples import CASES, EXAMPLES, check_example, run_example

TWO_NODES = ["cluster.executor=slurm", "cluster.nodes=2", "cluster.ranks_per_node=1"]


@pytest.mark.parametrize(
    "name", sorted(n for n, case in CASES.items() if case.user_files and not case.on_slurm_only)
)
def test_the_example_trains_on_two_slurm_nodes(tmp_path: Path, name: str) -> None:
    ran = run_example(name, tmp_path, TWO_NODES)
    check_example(name, ran)
    train = ran.kids["train"].data.tags
    assert train["slurm_node_list"] == "tfnode[1-2]", train
    assert train["slurm_state"] == "COMPLETED", train
    (run,) = (tmp_path / "work" / "runs").iterdir()
    code = (run / "jobs" / "code").resolve()
    model = CASES[name].model
    imported = {
        log.name: re.findall(rf"^model {re.escape(model)} from (\S+)$", log.read_text(), re.M)
        for log in sorted((run / "jobs").glob("*_log.out"))
    }
    assert len(imported) == 2 and all(len(files) == 1 for files in imported.values()), imported
    for files in imported.values():
        file = Path(files[0]).resolve()
        assert file.is_relative_to(code), (file, code)
        assert not file.is_relative_to(EXAMPLES), file
        assert file.name == model.split(":")[0] + ".py", file


def test_the_tensor_parallel_example_trains_on_two_nodes_of_two_ranks(tmp_path: Path) -> None:
    """examples/charlm/charlm_tp.toml as its comment says: 2 nodes x 2 ranks, tp=2 within each
    node, FSDP2 over the nodes; it learns (check_example: below the unigram baseline)."""
    ran = run_example("charlm_tp", tmp_path, ["cluster.executor=slurm"])
    check_example("charlm_tp", ran)
    train = ran.kids["train"].data.tags
    assert train["slurm_node_list"] == "tfnode[1-2]", train
    (run,) = (tmp_path / "work" / "runs").iterdir()
    logs = sorted((run / "jobs").glob("*_0_log.out"))
    assert any("mesh dp_shard=2 x tp=2" in log.read_text() for log in logs), logs
