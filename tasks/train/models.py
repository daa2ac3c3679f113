"""The built-in networks and their factories: the founding material's CNN and a small ResNet
for images, an MLP for feature vectors and a small causal convolutional net for token
sequences; and how any built model is placed on its device (memory format, compilation).

The factories are registered in tasks.train.model_plugins and built through the same resolver
as a user's factory.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainflow.errors import ConfigError
from trainflow.tasks.spec import DataSpec
from trainflow.tasks.train.config import TrainConfig


def _reference_feature_size(size: int) -> int:
    """Spatial size after conv3 -> pool2 -> conv3 -> pool2 (no padding, floor pooling)."""
    return ((size - 2) // 2 - 2) // 2


class ReferenceCNN(nn.Module):
    """The founding material's CNN, generalised to any channel count, class count and size.

    conv(in->16, k3) -> ReLU -> maxpool2 -> conv(16->32, k3) -> ReLU -> maxpool2 -> linear.
    The forward pass pools before the ReLU: the same function with the same gradients
    (ReLU is monotonic, so it commutes with max), on a quarter of the elements.
    """

    def __init__(self, in_channels: int, num_classes: int, height: int, width: int) -> None:
        super().__init__()
        h, w = _reference_feature_size(height), _reference_feature_size(width)
        if h < 1 or w < 1:
            raise ConfigError(
                f"reference_cnn needs images of at least 10x10 pixels, got {height}x{width}: "
                "use train.model=resnet or resize the images in preprocessing"
            )
        self.conv1 = nn.Conv2d(in_channels, 16, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32 * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, num_classes)."""
        # relu(pool(.)) == pool(relu(.)): 1.3-1.6x faster steps at batch 64 on CPU.
        x = F.relu(self.pool(self.conv1(x)))
        x = F.relu(self.pool(self.conv2(x)))
        return self.fc(torch.flatten(x, 1))


class BasicBlock(nn.Module):
    """Two 3x3 conv+BN layers with an identity (or 1x1 projection) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual output of the same batch size, out_channels channels."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet: stem, 3 stages of 2 BasicBlocks (widths w, 2w, 4w), avg pool, linear."""

    def __init__(self, in_channels: int, num_classes: int, width: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        widths = [width, 2 * width, 4 * width]
        stages: list[nn.Module] = []
        previous = width
        for index, stage_width in enumerate(widths):
            stride = 1 if index == 0 else 2
            stages += [
                BasicBlock(previous, stage_width, stride),
                BasicBlock(stage_width, stage_width, 1),
            ]
            previous = stage_width
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)

    def shard_units(self) -> list[nn.Module]:
        """The residual blocks: train.strategy=fsdp shards each on its own."""
        return list(self.stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, num_classes)."""
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def reference_cnn(spec: DataSpec) -> nn.Module:
    """Factory of the built-in `reference_cnn`: ReferenceCNN sized for spec's images."""
    channels, height, width = _image_classes(spec, "reference_cnn")
    return ReferenceCNN(channels, int(spec.num_classes or 0), height, width)


def resnet(spec: DataSpec, width: int = 32) -> nn.Module:
    """Factory of the built-in `resnet`: ResNet of base width `width` for spec's images."""
    channels, _, _ = _image_classes(spec, "resnet")
    return ResNet(channels, int(spec.num_classes or 0), width)


def _image_classes(spec: DataSpec, name: str) -> tuple[int, int, int]:
    """(C, H, W) of spec's samples; ConfigError unless spec is image classification."""
    if spec.objective != "classification" or len(spec.sample_shape) != 3:
        raise ConfigError(
            f"train.model={name} classifies images (C, H, W), but the data are {spec.objective} "
            f"of samples shaped {spec.sample_shape}: use train.model=mlp (features), "
            "token_conv (token ids) or a model of your own (train.model=package.module:factory)"
        )
    channels, height, width = spec.sample_shape
    return channels, height, width


class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU] x depth -> Linear to the objective's output shape."""

    def __init__(self, spec: DataSpec, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.out_shape = spec.output_shape(1)[1:]
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(spec.sample_shape)
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, math.prod(self.out_shape)))
        self.net = nn.Sequential(*layers)

    def shard_units(self) -> list[nn.Module]:
        """The linear layers: train.strategy=fsdp shards each on its own."""
        return [m for m in self.net if isinstance(m, nn.Linear)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, *output_shape): logits or values."""
        return self.net(x).reshape(x.shape[0], *self.out_shape)


class TokenConv(nn.Module):
    """Embedding -> two causal 1-D convolutions (kernel 3, left padding) -> logits per
    position: position t sees tokens <= t only, so it can learn next-token prediction."""

    def __init__(self, spec: DataSpec, dim: int = 64) -> None:
        super().__init__()
        vocab = int(spec.num_classes or 0)
        self.embed = nn.Embedding(vocab, dim)
        self.convs = nn.ModuleList(nn.Conv1d(dim, dim, 3) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def shard_units(self) -> list[nn.Module]:
        """The convolutions: train.strategy=fsdp shards each on its own."""
        return list(self.convs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, T, vocabulary) logits for (batch, T) token ids."""
        h = self.embed(x).transpose(1, 2)
        for conv in self.convs:
            h = h + F.relu(conv(F.pad(h, (2, 0))))
        return self.head(h.transpose(1, 2))


def mlp(spec: DataSpec, hidden: int = 64, depth: int = 2) -> nn.Module:
    """Factory of the built-in `mlp`: any float input, any objective's output shape."""
    return MLP(spec, hidden=hidden, depth=depth)


def token_conv(spec: DataSpec, dim: int = 64) -> nn.Module:
    """Factory of the built-in `token_conv`: next-token logits per position for token ids."""
    if spec.num_classes is None or spec.sample_dtype != "int64":
        raise ConfigError(
            f"train.model=token_conv reads token ids, but the data are {spec.sample_dtype} "
            f"samples shaped {spec.sample_shape}: use train.model=mlp or a model of your own"
        )
    return TokenConv(spec, dim=dim)


NHWC_MIN_CHANNELS_CPU = 8
"""auto turns channels_last off on CPU for narrower convolutions: oneDNN's NHWC 1x1 backward
(jit_avx2_1x1_convolution_bwd_weights) spins for minutes on a 4-channel resnet (width 4,
3x32x32 input) where NCHW takes a second (torch 2.13.0+cpu); width 8 is fine."""


def narrowest_conv(model: nn.Module) -> int:
    """The fewest output channels of any 2-D convolution of `model` (ReferenceCNN: 16); 0 when
    it has none (channels_last has nothing to speed up)."""
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    return min(widths, default=0)


def use_channels_last(
    pref: str, device: torch.device, narrowest: int | None = None, strategy: str = "ddp"
) -> bool:
    """Whether images and conv weights take the channels_last (NHWC) memory format.

    auto: on CUDA (tensor-core convolutions want NHWC) and on CPUs with oneDNN, whose NHWC
    kernels avoid reordering each activation (reference CNN, batch 64, bf16: 6.3k -> 13.7k
    samples/s on one core), unless the model's narrowest convolution (`narrowest`) has fewer
    than NHWC_MIN_CHANNELS_CPU channels, and never for a model without 2-D convolutions
    (`narrowest` 0), nor under train.strategy=fsdp: FSDP2 shards contiguous parameters only
    (channels_last conv weights are not; TrainConfig refuses channels_last=on with fsdp).
    """
    if strategy == "fsdp":
        return False
    if pref == "auto":
        if narrowest == 0:
            return False
        if device.type == "cuda":
            return True
        narrow = narrowest is not None and narrowest < NHWC_MIN_CHANNELS_CPU
        return device.type == "cpu" and torch.backends.mkldnn.is_available() and not narrow
    return pref == "on"


def uses_cuda_graphs(cfg: TrainConfig, device: torch.device) -> bool:
    """True when the run asked for CUDA graphs and trains on a GPU (elsewhere they are off)."""
    return cfg.cuda_graphs and device.type == "cuda"


def place_model(model: nn.Module, cfg: TrainConfig, device: torch.device) -> nn.Module:
    """Move `model` to `device` in the configured memory format, compiled if asked for
    (under train.strategy=fsdp it stays on the host: wrap_fsdp moves it, unit by unit).

    Compiled in place (``Module.compile``): state_dict keys stay those of the plain module,
    so checkpoints do not depend on whether a run was compiled.

    CUDA graphs come from torch.compile's "reduce-overhead" mode (cudagraph trees) rather
    than a hand-made torch.cuda.graph capture of the whole step: it keeps DDP's all-reduce
    hooks, autocast, the GradScaler and the fused optimizer step outside the graphs, working
    as in eager mode, and falls back to plain compiled kernels (logged by inductor) where a
    graph cannot be recorded. dynamic=False: one static graph per batch shape (the train
    batches all have one shape when CUDA graphs are on; see rank_batches' drop_last).
    """
    narrowest = narrowest_conv(model)
    if cfg.strategy != "fsdp":  # fully_shard moves each unit to the device as it shards it:
        model = model.to(device)  # the device never holds more than one unit whole
    if use_channels_last(cfg.channels_last, device, narrowest, cfg.strategy):
        # Converts the 4-D conv weights only. torch's stubs lack the memory_format overload.
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    if device.type == "cuda":
        # Fixed input shapes: let cuDNN time its algorithms once and keep the fastest.
        torch.backends.cudnn.benchmark = True
    if uses_cuda_graphs(cfg, device):
        model.compile(mode="reduce-overhead", dynamic=False)
    elif cfg.compile:
        model.compile()
    return model
