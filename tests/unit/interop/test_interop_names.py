"""Each private name behind ``dpsweep/interop/`` still exists in the installed library, and each door
still does what its caller relies on: these tests fail the day a name moves (issue 57, item 3)."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import optuna
import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from torch import nn

from dpsweep.interop import (
    dp_accounting_private,
    hydra_private,
    hydra_submitit_private,
    opacus_private,
    optuna_private,
    submitit_private,
    torch_private,
    torchvision_private,
)

DOORS = [dp_accounting_private, hydra_private, opacus_private, optuna_private, torch_private, torchvision_private]


def resolve(module: str, path: str) -> object:
    """``module``'s object at the dotted ``path`` (AttributeError names what moved)."""
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("door", DOORS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_each_private_name_exists(door: ModuleType) -> None:
    """``module, "Class.attr"``: the attribute exists; ``"Class.__init__:_attr"``: the class's (or a base
    class's) source sets ``self._attr`` (an instance's state, which exists only once built)."""
    for module, path in door.PRIVATE_NAMES:
        where, _, attribute = path.partition(":")
        obj = resolve(module, where)
        if attribute:
            cls = getattr(obj, "__objclass__", None) or resolve(module, where.split(".")[0])
            assert isinstance(cls, type)
            sources = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.split(".")[0] != "builtins")
            sets = f"self.{attribute} =" in sources or f'__setattr__("{attribute}"' in sources
            assert sets, f"{module}.{where} no longer sets {attribute}"


def test_each_door_names_its_private_name() -> None:
    """Every public function of a door says in its docstring which private name it uses."""
    for door in DOORS:
        for name, function in inspect.getmembers(door, inspect.isfunction):
            if function.__module__ == door.__name__ and not name.startswith("_"):
                assert "Private name" in (function.__doc__ or ""), f"{door.__name__}.{name}"


@pytest.mark.parametrize("interface", [submitit_private.PLUGIN_INTERFACE, hydra_submitit_private.PLUGIN_INTERFACE])
def test_plugin_interfaces_exist(interface: dict[str, tuple[str, ...]]) -> None:
    """The base classes still have each name a plugin's subclass overrides or reads (an instance, for ``()``)."""
    for base, names in interface.items():
        module, _, qualname = base.partition(":")
        cls = resolve(module, qualname.removesuffix("()"))
        assert isinstance(cls, type)
        holder = cls() if qualname.endswith("()") else cls
        missing = [name for name in names if not hasattr(holder, name)]
        assert not missing, f"{base} has no {missing}"


def test_submitit_job_module_exists() -> None:
    assert importlib.util.find_spec(submitit_private.SUBMIT_MODULE) is not None


def test_hydra_doors_compose_as_hydra() -> None:
    parser = OverridesParser.create()
    cfg = OmegaConf.create({"train": {"seed": 0, "lr": 0.1}})
    hydra_private.apply_value_overrides(parser.parse_overrides(["train.seed=3", "+train.extra=x", "~train.lr"]), cfg)
    assert OmegaConf.to_container(cfg) == {"train": {"seed": 3, "extra": "x"}}
    task = parser.parse_overrides(["train.seed=3", "dp=off"])
    assert hydra_private.override_dirname(task, kv_sep="=", item_sep=",", exclude_keys=[]) == "dp=off,train.seed=3"
    assert hydra_private.sweep_jobs(parser.parse_overrides(["a=1,2", "b=x,y"])) == [
        ["a=1", "b=x"], ["a=1", "b=y"], ["a=2", "b=x"], ["a=2", "b=y"],
    ]  # fmt: skip
    hydra_private.check_multirun_overrides(parser.parse_overrides(["a=1,2"]))
    with pytest.raises(Exception, match="hydra"):
        hydra_private.check_multirun_overrides(parser.parse_overrides(["hydra.verbose=true,false"]))


def test_opacus_doors() -> None:
    model = GradSampleModule(nn.Linear(2, 1))
    assert isinstance(opacus_private.wrapped_module(model), nn.Linear)
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=2
    )
    for skip in (True, False):
        model(torch.ones(2, 2)).sum().backward()
        optimizer.signal_skip_step(do_skip=skip)
        optimizer.step()
        assert opacus_private.last_step_skipped(optimizer) is skip
        optimizer.zero_grad()
    assert opacus_private.last_step_skipped(torch.optim.SGD(model.parameters(), lr=0.1)) is False


def test_optuna_door_gives_the_running_trial() -> None:
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    asked = [study.ask() for _ in range(2)]
    trial = optuna_private.trial(study, 1)
    trial.report(0.5, step=1)
    assert trial.number == 1 and asked[1]._trial_id == trial._trial_id
    assert study.trials[1].intermediate_values == {1: 0.5}


def test_torch_doors() -> None:
    tensors, ends = [torch.zeros(3), torch.ones(2)], [torch.ones(3), torch.zeros(2)]
    torch_private.lerp_all_(tensors, ends, 0.25)
    assert torch.equal(tensors[0], torch.full((3,), 0.25)) and torch.equal(tensors[1], torch.full((2,), 0.75))
    hooked = nn.Linear(2, 1)
    hooked.register_full_backward_hook(lambda *args: None)
    plain = copy.deepcopy(hooked)
    plain._backward_hooks.clear()
    torch_private.forget_full_backward_hooks(plain)
    assert vars(plain)["_is_full_backward_hook"] == vars(nn.Linear(2, 1))["_is_full_backward_hook"]
    plain(torch.ones(1, 2)).sum().backward()  # no complaint of a full hook mixed with none


def test_torchvision_door_lists_a_flowers_split() -> None:
    from torchvision.datasets import Flowers102

    dataset = Flowers102.__new__(Flowers102)  # the state its __init__ sets from setid.mat, without the files
    dataset._image_files = ["a.jpg"]
    assert [p.name for p in torchvision_private.image_files(dataset)] == ["a.jpg"]
    assert torchvision_private.image_files(object()) == []


def _gaussian_pld(sigma: float, sample_rate: float, steps: int) -> object:
    from dp_accounting import pld

    return pld.privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=sample_rate, value_discretization_interval=1e-4, use_connect_dots=True
    ).self_compose(steps)


def _randomized_response_pld() -> object:  # a sparse PMF of a few points
    from dp_accounting import pld

    return pld.privacy_loss_distribution.from_randomized_response(0.2, 4, value_discretization_interval=1e-3)


@pytest.mark.parametrize(
    "build",
    [
        lambda: _gaussian_pld(1.0, 64 / 1437, 23),
        lambda: _gaussian_pld(1.1, 256 / 60000, 2000),
        lambda: _gaussian_pld(5.0, 1.0, 1),
        _randomized_response_pld,
    ],
    ids=["digits default", "mnist-like", "gaussian", "randomized response (sparse)"],
)
def test_dp_accounting_door_reads_the_profile_as_dp_accounting(build: Callable[[], object]) -> None:
    """The numpy read of a PLD's δ(ε) gives dp-accounting's own figures (to round-off; bit for bit on the
    development VM): both directions (a subsampled PLD is asymmetric; σ=5 at q=1 a plain Gaussian), the
    mass at infinity, ε below every loss (δ=1 region), exactly on the loss grid, beyond the largest loss."""
    built: Any = build()
    grid = np.linspace(-2.0, 12.0, 1401)  # 0.01 apart: on the grid of 1e-4 and 1e-3 losses (to round-off)
    epsilons = np.concatenate((grid, [50.0, np.inf]))
    expected = np.asarray(built.get_delta_for_epsilon(epsilons), dtype=float)
    got = dp_accounting_private.deltas_for_epsilons(built, epsilons)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-300)
    assert expected[0] > 0.05 and expected[-2] < 1e-3  # the grid spans the profile's range
    with pytest.raises(ValueError, match="ascending"):
        dp_accounting_private.deltas_for_epsilons(built, np.array([1.0, np.nan]))
