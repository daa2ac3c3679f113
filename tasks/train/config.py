"""Config of the training stage: model, optimisation, precision, checkpointing."""

from typing import Literal

from pydantic import Field

from tasks.base import StrictModel


class TrainConfig(StrictModel):
    """What to train and how."""

    model: Literal["reference_cnn", "resnet"] = "reference_cnn"
    """reference_cnn: the founding material's CNN; resnet: a small residual net."""
    width: int = Field(32, ge=4, le=1024)
    """Base channel width of the resnet (ignored by reference_cnn)."""
    epochs: int = Field(8, ge=1, le=10_000)
    """Passes over the training split."""
    batch_size: int = Field(64, ge=1, le=65_536)
    """Samples per rank per optimiser step."""
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """adamw, or sgd with momentum 0.9."""
    lr: float = Field(2e-3, gt=0.0, le=10.0)
    """Peak learning rate (cosine decay to 0 over the run)."""
    weight_decay: float = Field(1e-4, ge=0.0, le=1.0)
    """Decoupled weight decay."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto: bf16 autocast where the device supports it, else fp16 + GradScaler on GPU,
    else fp32. bf16/fp16 force that dtype; fp32 disables autocast."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: cuda when the rank sees a GPU, else cpu."""
    seed: int = 0
    """Seed of weights and data order."""
    log_every_epochs: int = Field(1, ge=1)
    """Metrics are flushed to MLflow in one batch every N epochs."""
