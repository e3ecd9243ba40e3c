"""Models: the Opacus example CNN's shapes, and frozen VGG16 training only its head."""

from __future__ import annotations

import pytest
import torch

from dpsweep.config import CNNConfig, ConfigError, MLPConfig, VGG16FrozenConfig
from dpsweep.models import classifiers


def test_cnn_is_the_opacus_mnist_network() -> None:
    net = classifiers.build(CNNConfig(), (1, 28, 28), 10)
    assert isinstance(net, classifiers.OpacusCNN)
    assert (net.conv1.out_channels, net.conv1.kernel_size, net.conv1.stride, net.conv1.padding) == (
        16,
        (8, 8),
        (2, 2),
        (3, 3),
    )
    assert (net.conv2.out_channels, net.conv2.kernel_size, net.conv2.stride) == (32, (4, 4), (2, 2))
    assert net.fc1.in_features == 512 and net.fc1.out_features == 32
    assert net(torch.zeros(5, 1, 28, 28)).shape == (5, 10)


def test_cnn_adapts_to_channels_size_and_width() -> None:
    net = classifiers.build(CNNConfig(hidden_units=7), (3, 32, 32), 4)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 4)
    assert net.fc1.in_features == 32 * 5 * 5 and net.fc1.out_features == 7


def test_cnn_rejects_images_too_small() -> None:
    with pytest.raises(ConfigError, match=r"dataset.image_size=8 .*at least 13"):
        classifiers.build(CNNConfig(), (1, 8, 8), 10)


@pytest.fixture(scope="module")
def vgg() -> torch.nn.Module:
    return classifiers.build(VGG16FrozenConfig(pretrained=False, hidden_units=16, dropout=0.5), (1, 32, 32), 10)


def test_vgg16_frozen_trains_only_the_head(vgg: torch.nn.Module) -> None:
    trainable = {n for n, p in vgg.named_parameters() if p.requires_grad}
    assert trainable == {"head.0.weight", "head.0.bias", "head.3.weight", "head.3.bias"}
    assert classifiers.trainable_parameters(vgg) == 25088 * 16 + 16 + 16 * 10 + 10
    head = list(vgg.head)
    assert [type(m).__name__ for m in head] == ["Linear", "ReLU", "Dropout", "Linear"]


def test_vgg16_frozen_features_get_no_gradient(vgg: torch.nn.Module) -> None:
    x = torch.randn(2, 1, 32, 32)  # grey-scale is repeated to three channels
    vgg.train()
    vgg(x).sum().backward()
    assert all(p.grad is None for p in vgg.features.parameters())
    assert all(p.grad is not None for p in vgg.head.parameters())


def test_vgg16_rejects_images_below_32px() -> None:
    with pytest.raises(ConfigError, match="at least 32 pixels"):
        classifiers.build(VGG16FrozenConfig(pretrained=False), (3, 28, 28), 10)


def test_unknown_model_lists_the_valid_ones() -> None:
    with pytest.raises(KeyError, match="valid: cnn, mlp, vgg16_frozen"):
        classifiers.build(CNNConfig(name="resnet"), (1, 28, 28), 10)


def test_mlp_is_one_hidden_layer_on_the_flattened_pixels() -> None:
    model = classifiers.build(MLPConfig(hidden_units=16), (1, 8, 8), 10)
    assert classifiers.trainable_parameters(model) == 64 * 16 + 16 + 16 * 10 + 10
    x = torch.randn(5, 1, 8, 8)
    assert model(x).shape == (5, 10)
    assert torch.equal(model(x), model.fc2(torch.relu(model.fc1(x.reshape(5, 64)))))  # type: ignore[operator]
