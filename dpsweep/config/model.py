"""The model/ group: the network a run trains, and the checks of ``model.*``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import MISSING

from dpsweep.config.checks import require

if TYPE_CHECKING:
    from dpsweep.config.schema import Config


@dataclass
class ModelConfig:
    name: str = MISSING
    hidden_units: int = 32  # width of the trained dense layer


@dataclass
class CNNConfig(ModelConfig):
    """The Opacus MNIST example network, trained from scratch."""

    name: str = "cnn"
    hidden_units: int = 32  # width of the dense layer (the Opacus example's 512 -> 32 on 28x28 inputs)


@dataclass
class MLPConfig(ModelConfig):
    """Flattened pixels -> dense(hidden_units) -> ReLU -> dense(classes), trained from scratch."""

    name: str = "mlp"
    hidden_units: int = 16


@dataclass
class VGG16FrozenConfig(ModelConfig):
    """torchvision VGG16 with frozen convolutional features and a trained MLP head."""

    name: str = "vgg16_frozen"
    hidden_units: int = 512  # head width: the head dominates DP memory (B x trainable params)
    pretrained: bool = True  # ImageNet weights (torchvision's IMAGENET1K_V1); false initialises randomly
    dropout: float = 0.0  # dropout probability between the head's two layers; 0 disables it
    # Compute the frozen convolutional features once per (dataset, split, image size, weights) and
    # train the head on them (dpsweep.models.feature_cache); false recomputes them every step.
    feature_cache: bool = True
    feature_cache_dir: str = "cache/features"  # content-keyed feature files, relative to where dpsweep runs


def check(cfg: Config) -> None:
    """The trained layer's width, and vgg16_frozen's dropout."""
    m = cfg.model
    require(m.hidden_units > 0, "model.hidden_units", m.hidden_units, "a positive integer")
    if isinstance(m, VGG16FrozenConfig):
        require(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "a probability in [0, 1)")
