"""What a Slurm training job runs before and around its ranks: set-up lines and a container.

`cluster.setup` lines go into the job script before srun starts the ranks (`module load`,
`source venv/bin/activate`, `export ...`): submitit's own `setup` parameter. A
`cluster.container` runs every rank inside an image: Apptainer/Singularity by wrapping the
rank's command (`apptainer exec --bind ... IMAGE python3 ...`), Pyxis/enroot through srun's
`--container-image` and `--container-mounts`. The job's folder (pickles, logs, the code
snapshot) is always bound at its own path, so the ranks find it inside the image.
"""

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from trainflow.config_base import StrictModel

URI_SCHEMES = ("docker://", "docker-daemon://", "oras://", "library://", "shub://", "http")
"""Image references Apptainer pulls itself (not files on a shared file system)."""


class ContainerConfig(StrictModel):
    """An image every rank of a Slurm training job runs in."""

    image: str = Field(min_length=1)
    """apptainer/singularity: a .sif file on a file system the nodes share (checked before
    queueing) or a URI the nodes pull (docker://..., oras://...); pyxis: an image name
    (nvcr.io#nvidia/pytorch:25.01-py3) or a squashfs file. trainflow must be installed in it."""
    runtime: Literal["apptainer", "singularity", "pyxis"] = "apptainer"
    """apptainer or singularity: `exec` around each rank's command; pyxis: srun's
    --container-image (NVIDIA's Slurm plug-in with enroot)."""
    binds: list[str] = Field(default_factory=list)
    """Host paths made visible inside the image, `path` or `host:container` (apptainer --bind,
    pyxis --container-mounts): bind the dataset's and the workdir's file systems. The job's
    own folder is always bound."""
    python: str = "python3"
    """The Python inside the image that has trainflow installed."""
    options: list[str] = Field(default_factory=list)
    """More flags for `apptainer exec` (e.g. --cleanenv) or srun's pyxis options (e.g.
    --container-writable). apptainer's --nv is added for GPU jobs."""

    @field_validator("image", "python")
    @classmethod
    def _one_word(cls, value: str) -> str:
        if not value.strip() or any(c.isspace() for c in value):
            raise ValueError(f"{value!r} must be one word without spaces")
        return value

    @field_validator("binds")
    @classmethod
    def _binds(cls, binds: list[str]) -> list[str]:
        for bind in binds:
            host = bind.split(":")[0]
            if not host.startswith("/") or "," in bind or any(c.isspace() for c in bind):
                raise ValueError(
                    f"bind {bind!r}: give an absolute host path, `/path` or `/host:/container`, "
                    "one per entry (no commas or spaces)"
                )
        return binds

    @field_validator("options")
    @classmethod
    def _options(cls, options: list[str]) -> list[str]:
        for option in options:
            if not option.startswith("-"):
                raise ValueError(f"option {option!r} is not a flag: write it as '--name=value'")
        return options


def check_setup_lines(lines: list[str]) -> list[str]:
    """ValueError for a set-up line that is empty or holds a line break (one command a line)."""
    for line in lines:
        if not line.strip() or "\n" in line or "\r" in line:
            raise ValueError(
                f"setup line {line!r}: give one non-empty shell line per entry, e.g. "
                "'module load cuda/12.4' or 'source /shared/venv/bin/activate'"
            )
    return lines


@dataclass(frozen=True)
class RankLaunch:
    """How the job script starts a rank: `prefix` before the rank's command, the `python`
    that runs it, and srun's own arguments."""

    prefix: str = ""
    python: str | None = None
    srun_args: list[str] = field(default_factory=list)


def rank_launch(container: ContainerConfig | None, folder: Path, gpus: int) -> RankLaunch:
    """The launch of a rank in `container` (None: as it is), the job's `folder` bound."""
    if container is None:
        return RankLaunch()
    own = str(folder.resolve())
    if container.runtime == "pyxis":
        mounts = [own + ":" + own, *(b if ":" in b else f"{b}:{b}" for b in container.binds)]
        srun = [f"--container-image={container.image}", f"--container-mounts={','.join(mounts)}"]
        return RankLaunch("", container.python, [*srun, *container.options])
    words = [container.runtime, "exec", *(["--nv"] if gpus else [])]
    words += ["--bind", ",".join([own, *container.binds]), *container.options, container.image]
    return RankLaunch(shlex.join(words), container.python, [])


def check_image(container: ContainerConfig | None) -> None:
    """ValueError for an Apptainer image file that this machine does not see (the nodes share
    the file systems that hold a run's files, so they would not see it either)."""
    if container is None or container.runtime == "pyxis":
        return
    if container.image.startswith(URI_SCHEMES):
        return
    if not Path(container.image).is_file():
        raise ValueError(
            f"cluster.container.image={container.image!r}: no such file; build it with "
            "`apptainer build IMAGE.sif docker://...` on a shared file system, or give a "
            "docker:// or oras:// URI"
        )
