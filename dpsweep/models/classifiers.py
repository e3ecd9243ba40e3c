"""Models: a registry of image classifiers that Opacus can make private.

- ``cnn``: the network of Opacus's MNIST example, trained from scratch.
- ``mlp``: one hidden dense layer on the flattened pixels, trained from scratch: the smallest model,
  for privacy units with few contributors (e.g. 50 users), where the noise's norm grows as √P.
- ``vgg16_frozen``: torchvision's VGG16 with frozen convolutional features and a trained MLP head.

    python -c "from dpsweep import config, models; print(models.build(config.CNNConfig(), (1, 28, 28), 10))"
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from dpsweep.config import CNNConfig, ConfigError, MLPConfig, ModelConfig, VGG16FrozenConfig
from dpsweep.errors import InputError
from dpsweep.interop import torch_private
from dpsweep.registry import Registry

if TYPE_CHECKING:  # torchvision is imported where VGG16 is built: cnn runs never load it
    from torchvision.models import VGG, VGG16_Weights


class PretrainedWeightsError(InputError, FileNotFoundError):
    """Pretrained weights are neither in torch's cache nor downloadable: ``model.pretrained`` is bad input."""


ModelBuilder = Callable[[Any, tuple[int, int, int], int], nn.Module]
MODELS: Registry[ModelBuilder] = Registry("model")


def build(cfg: ModelConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Build the model ``cfg.name`` for inputs of shape (C, H, W) and ``num_classes`` outputs."""
    return MODELS.get(cfg.name, key="model.name")(cfg, input_shape, num_classes)


M = TypeVar("M", bound=nn.Module)
# what Opacus's GradSampleModule sets on the modules it wraps (opacus/grad_sample/grad_sample_module.py:
# add_hooks keeps the hook handles on the wrapped module, capture_activations_hook the last batch's
# activations on each hooked layer)
# the hook handles, the last batch's activations, and functorch mode's vmapped per-layer closure
OPACUS_MODULE_ATTRIBUTES = ("autograd_grad_sample_hooks", "activations", "ft_compute_sample_grad")


def released_copy(module: M) -> M:
    """A copy of ``module`` on the CPU, in eval mode, with its structure, parameters and buffers and
    nothing that training attached to it: no hooks (Opacus registers its per-sample gradient hooks on
    the module it wraps, and they hold the wrapper, ``GradSampleModule``), none of Opacus's attributes
    (the hook handles, the last batch's activations) and no attributes on the parameters
    (``grad_sample``, ``summed_grad``). A plain ``copy.deepcopy`` would copy all of it, so that the
    pickled model would need Opacus to load, and would compute per-sample gradients when used.

    The copy maps every hook dictionary, every parameter and each of those attributes to a fresh
    one (nothing of theirs is copied), then drops the attributes."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for name, value in vars(sub).items():
            if "hooks" in name and isinstance(value, dict):
                memo[id(value)] = type(value)()
            elif name in OPACUS_MODULE_ATTRIBUTES:
                memo[id(value)] = None
        for param in sub.parameters(recurse=False):
            memo[id(param)] = nn.Parameter(param.detach().to("cpu", copy=True), requires_grad=param.requires_grad)
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        for name in OPACUS_MODULE_ATTRIBUTES:
            vars(sub).pop(name, None)
        torch_private.forget_full_backward_hooks(sub)  # as a module without backward hooks has it
    return copied.to("cpu").eval()


def trainable_parameters(model: nn.Module) -> int:
    """P: the number of parameters that receive gradients (and per-sample gradients under DP)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


class OpacusCNN(nn.Module):
    """Opacus MNIST example CNN (opacus/examples/mnist.py, ``SampleConvNet``).

    conv(16, k8, s2, p3) -> ReLU -> maxpool(2, s1) -> conv(32, k4, s2) -> ReLU -> maxpool(2, s1)
    -> dense(hidden_units) -> ReLU -> dense(classes). On 1x28x28 inputs the first dense layer has
    32*4*4 = 512 inputs; other channel counts and sizes are measured with a dry run.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden_units: int = 32) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 16, kernel_size=8, stride=2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=4, stride=2)
        with torch.no_grad():
            try:
                flat = self._features(torch.zeros(1, channels, height, width)).shape[1]
            except RuntimeError as err:
                raise ConfigError("dataset.image_size", height, "at least 13 pixels for model cnn") from err
        self.fc1 = nn.Linear(flat, hidden_units)
        self.fc2 = nn.Linear(hidden_units, num_classes)

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self._features(x))))


@MODELS.register("cnn")
def build_cnn(cfg: CNNConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    return OpacusCNN(input_shape, num_classes, cfg.hidden_units)


class MLP(nn.Module):
    """dense(C*H*W -> hidden_units) -> ReLU -> dense(hidden_units -> classes) on the flattened image.
    On digits at their native 8x8 with 16 hidden units: 64*16+16 + 16*10+10 = 1,210 parameters."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, hidden_units: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.fc1 = nn.Linear(channels * height * width, hidden_units)
        self.fc2 = nn.Linear(hidden_units, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@MODELS.register("mlp")
def build_mlp(cfg: MLPConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    return MLP(input_shape, num_classes, cfg.hidden_units)


VGG16_MIN_SIZE = 32  # pixels: VGG16's five 2x2 max-pools need at least 32x32 inputs
VGG16_FEATURES = 512 * 7 * 7  # after torchvision's AdaptiveAvgPool2d((7, 7))


class FrozenVGG16(nn.Module):
    """VGG16 convolutional features (frozen, no gradients) + MLP head (trained).

    The head is Linear(25088 -> hidden_units), ReLU, [Dropout(p)], Linear(hidden_units -> classes).
    Grey-scale inputs are repeated to three channels.
    """

    def __init__(self, num_classes: int, hidden_units: int, pretrained: bool, dropout: float = 0.0) -> None:
        super().__init__()
        backbone = _vgg16(pretrained)
        self.features = backbone.features
        self.avgpool = backbone.avgpool
        for p in [*self.features.parameters(), *self.avgpool.parameters()]:
            p.requires_grad_(False)
        layers: list[nn.Module] = [nn.Linear(VGG16_FEATURES, hidden_units), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden_units, num_classes))
        self.head = nn.Sequential(*layers)

    def feature_maps(self, x: torch.Tensor) -> torch.Tensor:
        """Frozen convolutional maps (B, 512, H/32, W/32); no autograd graph is built through them."""
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        with torch.no_grad():
            return self.features(x)

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        """Frozen features (B, 25088): the maps pooled to 7x7 by torchvision's adaptive pool."""
        return torch.flatten(self.avgpool(self.feature_maps(x)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extract(x))

    def cached_head(self, map_shape: tuple[int, int, int]) -> PooledHead:
        """The trained part for inputs that are flattened :meth:`feature_maps` (the feature cache):
        ``cached_head(shape)(feature_maps(x).flatten(1)) == self(x)``. It shares ``self.head``."""
        return PooledHead(self.avgpool, self.head, map_shape)


class PooledHead(nn.Module):
    """Adaptive 7x7 average pool (no parameters) and the MLP head, on flattened convolutional maps.

    The feature cache stores the maps before the pool: at 32 px they are 512 values per image, where
    the pool would replicate the single position 49 times (25,088 values)."""

    def __init__(self, avgpool: nn.Module, head: nn.Module, map_shape: tuple[int, int, int]) -> None:
        super().__init__()
        self.avgpool, self.head, self.map_shape = avgpool, head, map_shape

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        maps = z.view(len(z), *self.map_shape)
        return self.head(torch.flatten(self.avgpool(maps), 1))


def _vgg16(pretrained: bool) -> VGG:
    """torchvision's VGG16, with ImageNet weights when ``pretrained``; a cached weights file that
    cannot be read (truncated, not a checkpoint) is bad input naming the file, not a torch traceback."""
    from torchvision.models import vgg16

    if not pretrained:
        return vgg16(weights=None)
    weights = _imagenet_weights()
    try:
        return vgg16(weights=weights)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
        raise PretrainedWeightsError(
            "model.pretrained", True,
            f"false, or an intact weights file: {cached} cannot be read ({type(err).__name__}: {err}); delete it "
            f"to download it again, or copy {weights.url} there",
        ) from err  # fmt: skip


def _imagenet_weights() -> VGG16_Weights:
    """ImageNet weights, from torch's cache or downloaded; a clear error when neither works."""
    from torchvision.models import VGG16_Weights

    weights = VGG16_Weights.IMAGENET1K_V1
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if cached.exists():
        return weights
    try:
        torch.hub.load_state_dict_from_url(weights.url, progress=True)
    except OSError as err:  # URLError and socket errors are OSErrors
        raise PretrainedWeightsError(
            "model.pretrained", True,
            f"false, or VGG16's ImageNet weights in torch's cache: they are not in {cached} and could not be "
            f"downloaded ({err}). Download {weights.url} into {cached.parent} (or set TORCH_HOME).",
        ) from err  # fmt: skip
    return weights


@MODELS.register("vgg16_frozen")
def build_vgg16_frozen(cfg: VGG16FrozenConfig, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    channels, height, width = input_shape
    if min(height, width) < VGG16_MIN_SIZE:
        raise ConfigError("dataset.image_size", height, f"at least {VGG16_MIN_SIZE} pixels for model vgg16_frozen")
    if channels not in (1, 3):
        raise ConfigError("dataset", f"{channels} channels", "1 or 3 channels for model vgg16_frozen")
    return FrozenVGG16(num_classes, cfg.hidden_units, cfg.pretrained, cfg.dropout)
