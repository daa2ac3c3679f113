"""Preprocess an image folder on a dask cluster, then train on it streaming: run inside a
memory cgroup by test_memory_limit.py. Prints each process's peak RSS (MiB) on its last line."""

import json
import re
import sys
from pathlib import Path

from cluster.config import DaskConfig
from cluster.dask import dask_client
from tasks.preprocess.config import PreprocessConfig
from tasks.preprocess.run import run_preprocess
from tasks.preprocess.sources import fingerprint


def vm_hwm() -> int:
    """This process's peak RSS in MiB."""
    text = Path("/proc/self/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(match[1]) >> 10 if match else 0


def main(raw: Path, work: Path) -> None:
    cfg = PreprocessConfig(
        source="folder",
        path=raw,
        image_size=(32, 32),
        val_fraction=0.45,
        test_fraction=0.44,
        shard_size=8192,
    )
    with dask_client(DaskConfig(backend="cpu", n_workers=1, memory_limit="0")) as (client, be):
        ref = run_preprocess(cfg, work / "datasets", client, be, fingerprint(cfg))
        worker_peak = max(client.run(vm_hwm).values())
    # Imported only now: dask's worker processes start by importing this module (spawn), and
    # should not carry torch.
    from tasks.train.config import TrainConfig
    from tasks.train.job import TrainingJob, TrainJobSpec

    train = TrainConfig(
        epochs=1,
        batch_size=512,
        width=4,
        device="cpu",
        precision="fp32",
        data_placement="stream",
    )
    result = TrainingJob(TrainJobSpec(train=train, dataset=ref, out_dir=work / "run"))()
    assert result is not None
    print(json.dumps({"counts": ref.counts, "flow_mib": vm_hwm(), "worker_mib": worker_peak}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
