"""The networks: shapes, the founding CNN's exact layout, size checks, model choice."""

import pytest
import torch
from torch import nn

from trainflow.errors import ConfigError
from trainflow.tasks.spec import image_classification
from trainflow.tasks.train.config import TrainConfig
from trainflow.tasks.train.model_plugins import build_model
from trainflow.tasks.train.models import BasicBlock, ReferenceCNN, ResNet


def test_reference_cnn_on_cifar_size_is_the_founding_net() -> None:
    net = ReferenceCNN(3, 10, 32, 32)
    assert (net.conv1.in_channels, net.conv1.out_channels) == (3, 16)
    assert (net.conv2.in_channels, net.conv2.out_channels) == (16, 32)
    assert net.fc.in_features == 32 * 6 * 6
    assert net(torch.randn(5, 3, 32, 32)).shape == (5, 10)


@pytest.mark.parametrize(
    ("shape", "features"), [((1, 28, 28), 32 * 5 * 5), ((1, 12, 12), 32), ((2, 10, 17), 32 * 2)]
)
def test_reference_cnn_sizes_its_linear_layer_from_the_input(
    shape: tuple[int, int, int], features: int
) -> None:
    net = ReferenceCNN(shape[0], 4, shape[1], shape[2])
    assert net.fc.in_features == features
    assert net(torch.randn(2, *shape)).shape == (2, 4)


def test_reference_cnn_refuses_images_too_small() -> None:
    with pytest.raises(ConfigError, match="at least 10x10"):
        ReferenceCNN(1, 4, 9, 32)


@pytest.mark.parametrize("shape", [(1, 12, 12), (3, 32, 32), (1, 5, 7)])
def test_resnet_outputs_logits_for_any_size(shape: tuple[int, int, int]) -> None:
    net = ResNet(shape[0], 7, width=4)
    assert net(torch.randn(3, *shape)).shape == (3, 7)


def test_resnet_has_three_stages_of_two_blocks_widening() -> None:
    net = ResNet(1, 10, width=8)
    blocks = [m for m in net.stages if isinstance(m, BasicBlock)]
    assert [b.conv2.out_channels for b in blocks] == [8, 8, 16, 16, 32, 32]
    assert [b.conv1.stride[0] for b in blocks] == [1, 1, 2, 1, 2, 1]
    assert net.fc.in_features == 32


def test_basic_block_projects_the_shortcut_only_when_shapes_change() -> None:
    assert isinstance(BasicBlock(8, 8, 1).shortcut, nn.Identity)
    assert isinstance(BasicBlock(8, 16, 2).shortcut, nn.Sequential)
    assert BasicBlock(8, 16, 2)(torch.randn(2, 8, 6, 6)).shape == (2, 16, 3, 3)


@pytest.mark.services
def test_resnet_trains() -> None:
    torch.manual_seed(0)
    net = ResNet(1, 2, width=4)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 2, (16,))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(net(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_build_model_follows_the_config() -> None:
    cnn = build_model(TrainConfig(model="reference_cnn"), image_classification((1, 12, 12), 3))
    resnet = build_model(TrainConfig(model="resnet", width=6), image_classification((1, 12, 12), 3))
    assert isinstance(cnn, ReferenceCNN) and cnn.fc.out_features == 3
    assert isinstance(resnet, ResNet) and resnet.fc.in_features == 24
