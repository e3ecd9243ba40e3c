"""K trials on one device: each trial's share of the GPU memory, the K that fits, and a trial's plan."""

from __future__ import annotations

import pytest
from helpers import Composer

from dpsweep.config import ConfigError, LauncherConfig, to_config, trials_per_device, validate
from dpsweep.memory.packing import CUDA_CONTEXT_BYTES, trial_share_bytes, trials_that_fit
from dpsweep.memory.predict import gpu_budget

GIB = 2**30


def test_one_trial_has_the_whole_budget_and_k_trials_lose_a_context_each_beyond_the_first() -> None:
    assert trial_share_bytes(80 * GIB, 1) == 80 * GIB
    assert trial_share_bytes(80 * GIB, 4) == (80 * GIB - 3 * CUDA_CONTEXT_BYTES) // 4
    with pytest.raises(ValueError, match="1 or more"):
        trial_share_bytes(80 * GIB, 0)


@pytest.mark.parametrize("need_gib", [0.3, 1.0, 7.5, 19.0, 26.7, 39.0])
@pytest.mark.parametrize("headroom", [0.0, 0.02])
def test_the_k_that_fits_is_the_largest_whose_shares_hold_every_trial(need_gib: float, headroom: float) -> None:
    gpu = 80 * GIB
    k = trials_that_fit([need_gib * GIB / 3, need_gib * GIB], gpu, headroom, cap=1000)  # the largest trial decides
    assert trial_share_bytes(gpu, k) * (1 - headroom) >= need_gib * GIB
    assert trial_share_bytes(gpu, k + 1) * (1 - headroom) < need_gib * GIB


def test_the_k_that_fits_is_capped_and_never_below_one() -> None:
    assert trials_that_fit([GIB], 80 * GIB, 0.02, cap=8) == 8  # e.g. the CPU cores, or the trials to run
    assert trials_that_fit([100 * GIB], 80 * GIB, 0.02, cap=8) == 1  # not even one fits: its own plan says so


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", ""])
def test_a_bad_number_of_trials_names_the_key(value: str) -> None:
    with pytest.raises(
        ConfigError, match=r"launcher.trials_per_device=.* a whole number of trials, 1 or more, or auto"
    ):
        trials_per_device(LauncherConfig(trials_per_device=value))


def test_auto_and_numbers_parse() -> None:
    assert trials_per_device(LauncherConfig(trials_per_device="auto")) is None
    assert trials_per_device(LauncherConfig(trials_per_device="4")) == 4
    assert trials_per_device(LauncherConfig()) == 1


def test_auto_needs_a_memory_model_and_a_budget_and_inline_runs_one_trial(make_cfg: Composer) -> None:
    with pytest.raises(ConfigError, match=r"auto with train\.memory_model"):
        validate(to_config(make_cfg("launcher=local", "launcher.trials_per_device=auto")))
    with pytest.raises(ConfigError, match="1 with launcher=inline"):
        validate(to_config(make_cfg("launcher.trials_per_device=3")))
    validate(to_config(make_cfg("launcher=slurm", "launcher.trials_per_device=3")))
    with pytest.raises(
        ConfigError, match=r"launcher.gpus_per_job=2 is invalid: 0 or 1 with launcher.trials_per_device=3"
    ):
        validate(to_config(make_cfg("launcher=slurm", "launcher.trials_per_device=3", "launcher.gpus_per_job=2")))
    validate(to_config(make_cfg("launcher=slurm", "launcher.trials_per_device=3", "launcher.gpus_per_job=1")))
    validate(to_config(make_cfg("launcher=slurm", "launcher.gpus_per_job=2")))  # one trial may hold two


def test_a_trial_plans_against_its_share(make_cfg: Composer) -> None:
    alone = to_config(make_cfg("launcher=local", "launcher.gpu_memory=80GiB"))
    packed = to_config(make_cfg("launcher=local", "launcher.gpu_memory=80GiB", "launcher.trials_per_device=4"))
    assert gpu_budget(alone) == ("80GiB", 80 * GIB)
    assert gpu_budget(packed) == ("80GiB shared by 4 trials", trial_share_bytes(80 * GIB, 4))
    assert gpu_budget(packed, "40GiB")[1] == trial_share_bytes(40 * GIB, 4)  # --gpu-memory is shared the same way
