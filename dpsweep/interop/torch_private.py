"""torch's private names: the door to them.

torch has fused multi-tensor kernels (``torch._foreach_*``) with no public entry point outside its
optimizers, and a module's record of full backward hooks is a private attribute of ``nn.Module``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

PRIVATE_NAMES = (  # (module, attribute path): what tests/unit/interop checks still exists
    ("torch", "_foreach_lerp_"),
    ("torch.nn.modules.module", "Module.__init__:_is_full_backward_hook"),
)


def lerp_all_(tensors: Sequence[torch.Tensor], ends: Sequence[torch.Tensor], weight: float) -> None:
    """``t.lerp_(end, weight)`` for each pair, in one fused multi-tensor kernel (an EMA of a model's
    parameters: one launch for all of them rather than one per tensor on a GPU).

    Private name: ``torch._foreach_lerp_``. torch exposes its multi-tensor kernels only through its
    optimizers' ``foreach=True``; there is no public ``foreach`` lerp."""
    torch._foreach_lerp_(list(tensors), list(ends), weight)


def forget_full_backward_hooks(module: nn.Module) -> None:
    """Mark ``module`` as having no full backward hooks, as a fresh module is (a copy of a hooked
    module whose hook handles were left behind).

    Private name: ``torch.nn.Module._is_full_backward_hook``. A module's hooks are removed through
    their handles; a copy made without the handles has no public way to reset the flag."""
    module._is_full_backward_hook = None
