"""Opacus's private attributes: the door to them.

Opacus (1.5, 1.6) keeps two facts that a training loop needs behind underscores: whether the last
``optimizer.step()`` only accumulated (a logical batch's pass before its last, ``signal_skip_step``)
and the module a ``GradSampleModule`` wraps. Each function here reads one of them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

PRIVATE_NAMES = (  # (module, attribute path): what tests/unit/interop checks still exists
    ("opacus.optimizers.optimizer", "DPOptimizer.__init__:_is_last_step_skipped"),
    ("opacus.grad_sample.gsm_base", "AbstractGradSampleModule.__init__:_module"),
)


def last_step_skipped(optimizer: Any) -> bool:
    """Whether the optimizer's last ``step()`` only clipped and accumulated, without noise or an
    update (Opacus's skipped step of a logical batch in several passes); False for an optimizer that
    is not Opacus's.

    Private name: ``opacus.optimizers.DPOptimizer._is_last_step_skipped``. ``DPOptimizer.step`` returns
    the wrapped optimizer's result (None both ways) and ``pre_step``'s answer is not kept; Opacus's own
    ``zero_grad`` reads this flag."""
    return bool(getattr(optimizer, "_is_last_step_skipped", False))


def wrapped_module(model: nn.Module) -> nn.Module:
    """The module a ``GradSampleModule`` wraps, hooks left in place (``model`` itself if it wraps none).

    Private name: ``opacus.grad_sample.GradSampleModule._module``. Opacus's public
    ``to_standard_module()`` returns it only after removing the hooks, which ends the private training."""
    wrapped = getattr(model, "_module", model)
    assert isinstance(wrapped, nn.Module)
    return wrapped
