"""DPAM's record of its Poisson samples (``DPAMRun.sampled_units``): what the runner's sampling check
(issue 58, item 3) reads of a run that has no private step to wrap."""

from __future__ import annotations

import torch
from helpers import Composer

from dpsweep import tasks
from dpsweep.config import population
from dpsweep.mechanisms.private_step import SampledUnits
from dpsweep.run import runner
from dpsweep.tasks.recommender import sgd
from dpsweep.tasks.recommender.task import DPAMRun
from dpsweep.tracking import SilentTracker

DPAM = [
    "task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
    "dataset.mean_ratings=15", "task.method=dpam", "dp.mechanism=dpsgd", "train.batch_size=100",
    "dp.noise_multiplier=1", "train.epochs=2",
]  # fmt: skip


class NoStages:
    """A training epoch's memory-stage log that records nothing."""

    def mark(self, stage: str) -> None:
        return None

    def stepped(self) -> None:
        return None


def _started(make_cfg: Composer) -> tuple[DPAMRun, tasks.Checkpointed]:
    """A DPAM run as the runner builds and starts it, with a tracker that logs nothing."""
    start = runner._start(make_cfg(*DPAM))
    inputs = tasks.RunInputs(start.config, start.plan, start.data, start.device, start.streams, start.ranks)
    run = tasks.get("recommender").build(inputs)
    assert isinstance(run, DPAMRun)
    parts = run.start(SilentTracker(start.config.tracking.uri, "0" * 32))
    return run, parts


def _sample_sizes(run: DPAMRun, steps: int) -> list[int]:
    """The sizes of the next ``steps`` Poisson samples of ``run``'s sampling stream, without moving it."""
    copy = torch.Generator(device=run.generator["sampling"].device)
    copy.set_state(run.generator["sampling"].get_state())
    rate = run.schedule.inclusion_probability
    return [len(sgd.sample_users(run.train.n_users, rate, copy)) for _ in range(steps)]


def test_dpam_counts_the_users_of_each_training_step_and_a_resumed_run_continues_the_steps(
    make_cfg: Composer,
) -> None:
    run, parts = _started(make_cfg)
    per_epoch = run.schedule.steps_per_epoch
    assert isinstance(run, SampledUnits) and per_epoch > 1
    run.memory_iteration(NoStages())  # a fixed batch of B users: no training step
    run.probe(NoStages())
    expected = _sample_sizes(run, per_epoch)
    run.train_epoch(1, NoStages())
    assert list(run.sampled_units()) == list(enumerate(expected))
    assert len(set(expected)) > 1, "Poisson samples: their sizes vary"
    # the check reads them against Binomial(N, q) of the plan and ledger: N is the users sampled from, q their rate
    assert population(run.cfg, run.inputs.plan.facts.n_train) == run.train.n_users
    assert {q for _, q, _ in run.privacy_ledger().dpsgd_segments()} == {run.schedule.inclusion_probability}

    # a resumed run: another process, from the checkpoint's parts; its steps continue from steps_taken()
    resumed, resumed_parts = _started(make_cfg)
    resumed_parts.model.load_state_dict(parts.model.state_dict())
    resumed_parts.generator.set_state(parts.generator.get_state())
    assert resumed.steps_taken() == per_epoch and not resumed.sampled_units()
    expected = _sample_sizes(resumed, per_epoch)
    resumed.train_epoch(2, NoStages())
    assert list(resumed.sampled_units()) == list(zip(range(per_epoch, 2 * per_epoch), expected, strict=True))
