"""cluster.setup and cluster.container: refused in one line before anything is queued, and
the launch each container runtime gets (the dev Slurm runs them: tests/slurm)."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.job_environment import ContainerConfig, check_image, rank_launch
from trainflow.cluster.slurm_checks import check_cluster
from trainflow.errors import ConfigError


def _refused(**fields: object) -> str:
    with pytest.raises(ValidationError) as err:
        ClusterConfig.model_validate({"executor": "slurm", **fields})
    return str(err.value)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"setup": ["module load cuda\nsource x"]}, "one non-empty shell line per entry"),
        ({"setup": ["  "]}, "one non-empty shell line per entry"),
        ({"container": {"image": "my image.sif"}}, "must be one word without spaces"),
        ({"container": {"image": "x.sif", "binds": ["data"]}}, "give an absolute host path"),
        ({"container": {"image": "x.sif", "binds": ["/a,/b"]}}, "one per entry"),
        ({"container": {"image": "x.sif", "options": ["cleanenv"]}}, "is not a flag"),
        ({"container": {"image": "x.sif", "runtime": "docker"}}, "'apptainer', 'singularity'"),
        ({"executor": "local", "setup": ["module load x"]}, "cluster.setup applies to the Slurm"),
        ({"executor": "local", "container": {"image": "x.sif"}}, "cluster.container applies"),
    ],
)
def test_a_malformed_environment_is_refused_in_one_line(
    fields: dict[str, object], says: str
) -> None:
    assert says in _refused(**fields)


def test_apptainer_wraps_the_rank_binding_the_job_folder_and_the_user_s_paths(
    tmp_path: Path,
) -> None:
    box = ContainerConfig(image="/img/train.sif", binds=["/data", "/scratch:/s"], options=["-e"])
    launch = rank_launch(box, tmp_path, gpus=0)
    assert launch.prefix == f"apptainer exec --bind {tmp_path},/data,/scratch:/s -e /img/train.sif"
    assert launch.python == "python3" and launch.srun_args == []
    gpu = rank_launch(box.model_copy(update={"runtime": "singularity"}), tmp_path, gpus=4)
    assert gpu.prefix.startswith("singularity exec --nv --bind ")


def test_pyxis_runs_the_rank_through_srun_s_container_options(tmp_path: Path) -> None:
    box = ContainerConfig(
        image="nvcr.io#nvidia/pytorch:25.01-py3", runtime="pyxis", binds=["/data"], python="python"
    )
    launch = rank_launch(box, tmp_path, gpus=8)
    assert launch.prefix == "" and launch.python == "python"
    assert launch.srun_args == [
        "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
        f"--container-mounts={tmp_path}:{tmp_path},/data:/data",
    ]
    assert rank_launch(None, tmp_path, gpus=0).prefix == ""


def test_an_image_file_nobody_can_see_is_refused_before_queueing(tmp_path: Path) -> None:
    missing = ClusterConfig.model_validate(
        {"executor": "slurm", "container": {"image": str(tmp_path / "nope.sif")}}
    )
    with pytest.raises(ConfigError, match=r"nope.sif'\: no such file; build it with"):
        check_cluster(missing)
    (tmp_path / "there.sif").write_bytes(b"")
    check_image(ContainerConfig(image=str(tmp_path / "there.sif")))
    check_image(ContainerConfig(image="docker://python:3.11"))  # pulled by the nodes
    check_image(ContainerConfig(image="nvcr.io#nvidia/pytorch:25.01-py3", runtime="pyxis"))
