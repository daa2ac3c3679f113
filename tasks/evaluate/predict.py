"""The test split streamed through the model: metrics without loading the split.

Batches are read from the shard files by the training stage's reader (tasks.train.streaming:
pread into two staging buffers, normalised at batch time with the manifest's statistics), in
shard order and in batches of evaluate.batch_size, exactly as the in-memory evaluation cut
them, so the predictions and every metric are the same. Memory is two batches plus the
(K, K) counts, whatever the split's size.
"""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from trainflow.tasks.preprocess.dataset import split_shards
from trainflow.tasks.preprocess.ref import DatasetRef
from trainflow.tasks.train.normalise import normaliser_of
from trainflow.tasks.train.outputs import logits_of
from trainflow.tasks.train.streaming import ShardRows, StreamedSplit

EXAMPLE_ROWS = 4
"""Normalised samples kept as the logged model's input example."""


def confusion_streamed(
    model: torch.nn.Module, dataset: DatasetRef, batch_size: int, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(confusion matrix (K, K) int64, input example) of a classifier on the test split.

    The example is the split's first EXAMPLE_ROWS normalised samples (float32, N C H W).
    verify=True checks each test shard's sha256 against the manifest first (read in blocks).
    """
    k = len(dataset.classes)
    cm = np.zeros((k, k), np.int64)
    example: list[np.ndarray] = []
    for output, y in test_batches(model, dataset, batch_size, example, verify):
        pred = output.argmax(dim=1)
        cm += np.bincount((y * k + pred).numpy(), minlength=k * k).reshape(k, k)
    return cm, example[0] if example else np.empty((0, *dataset.shape), np.float32)


def test_batches(
    model: torch.nn.Module,
    dataset: DatasetRef,
    batch_size: int,
    example: list[np.ndarray],
    verify: bool = True,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(output, target) of every test batch, in shard order, on the CPU; the first
    EXAMPLE_ROWS inputs as the model sees them (normalised, or token ids) are appended to
    `example`. verify=True checks each test shard's sha256 against the manifest first."""
    path = Path(dataset.path)
    split_shards(path, "test", verify=verify)
    split = StreamedSplit(ShardRows(path, "test"), normaliser_of(dataset))
    indices = list(torch.arange(len(split)).split(batch_size))
    with torch.inference_mode():
        for x, y in split.batches(indices, torch.device("cpu")):
            if not example:
                example.append(x[:EXAMPLE_ROWS].numpy().copy())
            yield logits_of(model(x)), y
