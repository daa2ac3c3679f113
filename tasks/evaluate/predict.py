"""The test split streamed through the model: a confusion matrix without loading the split.

Batches are read from the shard files by the training stage's reader (tasks.train.streaming:
pread into two staging buffers, normalised at batch time with the manifest's statistics), in
shard order and in batches of evaluate.batch_size, exactly as the in-memory evaluation cut
them, so the predictions and every metric are the same. Memory is two batches plus the
(K, K) counts, whatever the split's size.
"""

from pathlib import Path

import numpy as np
import torch

from trainflow.tasks.preprocess.dataset import split_shards
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.streaming import ShardRows, StreamedSplit

EXAMPLE_ROWS = 4
"""Normalised samples kept as the logged model's input example."""


def confusion_streamed(
    model: torch.nn.Module, dataset: DatasetRef, batch_size: int, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(confusion matrix (K, K) int64, input example) of `model` on the test split.

    The example is the split's first EXAMPLE_ROWS normalised samples (float32, N C H W).
    verify=True checks each test shard's sha256 against the manifest first (read in blocks).
    """
    k = len(dataset.classes)
    path = Path(dataset.path)
    split_shards(path, "test", verify=verify)
    split = StreamedSplit(ShardRows(path, "test"), dataset.mean, dataset.std)
    indices = list(torch.arange(len(split)).split(batch_size))
    cm = np.zeros((k, k), np.int64)
    example = np.empty((0, *dataset.shape), np.float32)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        for x, y in split.batches(indices, cpu):
            if len(example) < EXAMPLE_ROWS:
                example = x[:EXAMPLE_ROWS].numpy().copy()
            pred = model(x).argmax(dim=1)
            cm += np.bincount((y * k + pred).numpy(), minlength=k * k).reshape(k, k)
    return cm, example
