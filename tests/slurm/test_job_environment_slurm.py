"""cluster.setup and cluster.container on the dev Slurm: the set-up lines run in the job script
before the rank starts, and an Apptainer launch runs the rank through `apptainer exec`.

Apptainer does not install from this machine's package registries, so the container test puts
a stand-in `apptainer` first on the job's PATH (through cluster.setup): it records the
arguments trainflow gave it and runs the command after the image, as `apptainer exec` does
inside the image. That proves the generated command line runs a rank to its result; a real
image is not run here.
"""

import os
import sys
from pathlib import Path

import cloudpickle
import pytest

from trainflow.cluster.config import ClusterConfig
from trainflow.cluster.executor import make_executor

pytestmark = pytest.mark.timeout(180)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STAND_IN = """\
#!/bin/sh
# Stands in for apptainer: records its arguments, runs the command after the image.
echo "$@" >> "$(dirname "$0")/args"
[ "$1" = exec ] || exit 64
shift
while [ $# -gt 0 ]; do
  case "$1" in --bind) shift 2 ;; -*) shift ;; *) break ;; esac
done
export APPTAINER_CONTAINER="$1"
shift
exec "$@"
"""


def _seen() -> dict[str, str | None]:
    keys = ("MARK", "SECOND", "APPTAINER_CONTAINER")
    return {key: os.environ.get(key) for key in keys}


def test_setup_lines_run_before_the_rank_in_the_job_script(tmp_path: Path) -> None:
    (tmp_path / "env.sh").write_text("export MARK=from-setup\n")
    setup = [f"source {tmp_path / 'env.sh'}", 'export SECOND="$MARK-2"']
    cfg = ClusterConfig(executor="slurm", ranks_per_node=1, timeout_min=5, setup=setup)
    job = make_executor(cfg, tmp_path / "jobs").submit(_seen)
    seen = job.result()
    assert seen == {"MARK": "from-setup", "SECOND": "from-setup-2", "APPTAINER_CONTAINER": None}


def test_a_container_runs_each_rank_through_apptainer_exec(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STAND_IN)
    (bin_dir / "apptainer").chmod(0o755)
    image = tmp_path / "train.sif"
    image.write_bytes(b"")
    box = {"image": str(image), "binds": ["/var/tmp"], "python": sys.executable}
    cfg = ClusterConfig(
        executor="slurm",
        ranks_per_node=2,
        timeout_min=5,
        setup=[f"export PATH={bin_dir}:$PATH"],
        container=box,
    )
    folder = tmp_path / "jobs"
    job = make_executor(cfg, folder).submit(_seen)
    assert job.results() == [{"MARK": None, "SECOND": None, "APPTAINER_CONTAINER": str(image)}] * 2
    calls = (bin_dir / "args").read_text().splitlines()
    assert len(calls) == 2  # one a rank
    for call in calls:
        head = f"exec --bind {folder.resolve()},/var/tmp {image} {sys.executable} -u -m "
        assert call.startswith(head + "trainflow.cluster.rank_guard "), call
        assert f"{sys.executable} -u -m trainflow.cluster.rank_main " in call
