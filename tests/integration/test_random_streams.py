"""Releasable runs (issue 54, items 1 and 2): every private draw (Poisson sampling, noise, canaries, a
private clipping norm) comes from a stream of its own that the initial weights do not tell, and
``dp.secure_mode=true`` runs every mechanism from the OS's entropy.

The audit's finding, as a test: θ₀ reveals ``train.seed`` (a small seed is found by trying them), and
the batches and the noise were drawn from ``torch.manual_seed(train.seed)``'s stream. Here each
mechanism's first Poisson batch and first noise are compared with what that stream would draw."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import Composer, runs_of, train_interrupted
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig

from dpsweep import tasks
from dpsweep.config import ConfigError
from dpsweep.data.resident import Generators
from dpsweep.run import runner
from dpsweep.run.runner import train
from dpsweep.tasks.classifier.task import ClassifierRun
from dpsweep.tracking import SilentTracker

USER_LEVEL = ["dp.unit=user", "dataset.users=partition", "dataset.num_users=300", "train.batch_size=30"]
GAN = ["task=gan", "task.tstr_epochs=1", "task.critic_width=8", "task.generator_width=16"]
RECOMMENDER = [
    "task=recommender", "dataset.num_users=400", "dataset.held_out_users=60", "dataset.items=150",
    "dataset.mean_ratings=15", "train.batch_size=400",
]  # fmt: skip
DPAM = [*RECOMMENDER, "task.method=dpam", "dp.mechanism=dpsgd", "train.batch_size=100", "dp.max_grad_norm=0.1"]
SAMPLING = {  # every mechanism that samples: its overrides
    "dpsgd hooks": [],
    "dpsgd device-resident": ["train.device_resident=true"],
    "dpsgd fused": ["dp.grad_sample_mode=fused"],
    "dpsgd per user": USER_LEVEL,
    "dpsgd fused per user": [*USER_LEVEL, "dp.grad_sample_mode=fused"],
    "gan critic": GAN,
    "dpam": DPAM,
}
SEED = 3


def _built(cfg: DictConfig) -> tuple[tasks.TaskRun, tasks.Checkpointed, torch.Tensor]:
    """A run's task as the runner builds and starts it (no MLflow run: a tracker that logs nothing), its
    parts and the global generator's state right after the initial model was drawn."""
    start = runner._start(cfg)
    inputs = tasks.RunInputs(start.config, start.plan, start.data, start.device, start.streams, start.ranks)
    task_run = tasks.get(start.config.task.name).build(inputs)
    after_init = torch.get_rng_state()
    parts = task_run.start(SilentTracker(start.config.tracking.uri, "0" * 32))
    return task_run, parts, after_init


def _draws(generator: torch.Generator, n: int = 1000) -> torch.Tensor:
    """The first ``n`` uniforms of ``generator``, without moving it."""
    copy = torch.Generator(device=generator.device)
    copy.set_state(generator.get_state())
    return torch.rand(n, generator=copy, device=generator.device).cpu()


@pytest.mark.parametrize("mechanism", list(SAMPLING))
def test_the_first_batch_and_noise_are_not_drawn_from_the_stream_theta0_reveals(
    make_cfg: Composer, mechanism: str
) -> None:
    """The first Poisson batch (inclusion at q = 1/20 of 1,000 units) and the first noise differ from
    those of ``torch.manual_seed(train.seed)``'s stream, and from the global stream after the init,
    which is where Opacus and the user-level step drew their noise."""
    _, parts, after_init = _built(make_cfg(*SAMPLING[mechanism], f"train.seed={SEED}", "train.epochs=1"))
    assert isinstance(parts.generator, Generators), "a private run keeps its sampling and noise streams"
    init_stream = torch.Generator().manual_seed(SEED)
    global_stream = torch.Generator()
    global_stream.set_state(after_init)
    for purpose in ("sampling", "noise"):
        drawn = _draws(parts.generator[purpose]) < 0.05
        for public in (init_stream, global_stream):
            assert not torch.equal(drawn, _draws(public) < 0.05), f"{purpose} drawn from a public stream"
    assert not torch.equal(_draws(parts.generator["sampling"]), _draws(parts.generator["noise"]))


def test_dpftrl_and_dpals_noise_is_not_the_init_stream(make_cfg: Composer) -> None:
    """Mechanisms that do not sample: DP-FTRL's tree noise and DPALS's aggregator noise."""
    init_stream = torch.Generator().manual_seed(SEED)
    _, parts, _ = _built(make_cfg("dp.mechanism=dpftrl", f"train.seed={SEED}", "train.epochs=1"))
    tree: Any = parts.optimizer
    assert not torch.equal(_draws(tree.noise.generator), _draws(init_stream))
    _, parts, _ = _built(make_cfg(*RECOMMENDER, f"train.seed={SEED}", "train.epochs=1"))
    assert isinstance(parts.generator, Generators)
    assert not torch.equal(_draws(parts.generator["noise"]), _draws(init_stream))


def test_two_trials_with_one_seed_and_different_sigma_draw_different_batches(make_cfg: Composer) -> None:
    """Two configs of a sweep that share train.seed do not share their sampling or noise, unless
    dp.stream_seed asks for it."""
    drawn = []
    for sigma in (0.8, 1.6):
        _, parts, _ = _built(make_cfg(f"dp.noise_multiplier={sigma}", "train.epochs=1"))
        assert isinstance(parts.generator, Generators)
        drawn.append([_draws(parts.generator[p]) for p in ("sampling", "noise")])
    assert not any(torch.equal(a, b) for a, b in zip(*drawn, strict=True))
    shared = []
    for sigma in (0.8, 1.6):
        _, parts, _ = _built(make_cfg(f"dp.noise_multiplier={sigma}", "dp.stream_seed=11", "train.epochs=1"))
        assert isinstance(parts.generator, Generators)
        shared.append(_draws(parts.generator["noise"]))
    assert torch.equal(*shared)


def _weights(result: runner.TrainResult) -> torch.Tensor:
    assert result.model is not None
    return torch.cat([p.detach().flatten() for p in result.model.parameters()])


SECURE = {  # a mechanism of each kind of step, in secure mode
    "dpsgd hooks": [],
    "dpsgd fused": ["dp.grad_sample_mode=fused"],
    "dpsgd per user": USER_LEVEL,
    "dpftrl": ["dp.mechanism=dpftrl"],
    "quantile clipping": ["dp.clipping=quantile"],
}
SECURE_SLOW = {
    "gan critic": GAN,
    "dpals": RECOMMENDER,
    "dpam": DPAM,
    "white-box audit": ["audit.mode=white_box", "audit.canaries=200"],
    "black-box audit": ["audit.mode=black_box", "audit.canaries=50", "audit.guesses=20"],
    "adaptive clipping": ["dp.clipping=adaptive"],
}


def _two_secure_runs(make_cfg: Composer, client: MlflowClient, experiment: str, args: list[str]) -> None:
    """Two secure runs of one config: the same θ₀ and ε, other batches and noise (other weights), tagged
    for release, with no seed of their streams among their params or tags."""
    results = [train(make_cfg(*args, "dp.secure_mode=true", "train.epochs=1", "sweep.force=true")) for _ in "ab"]
    a, b = results
    assert a.epsilons == b.epsilons and a.steps == b.steps
    assert not torch.equal(_weights(a), _weights(b)), "two secure runs drew the same batches and noise"
    for run in runs_of(client, experiment):
        assert run.info.status == "FINISHED"
        audited = "audit.note" in run.data.tags  # an audit's model holds its canaries: never for release
        assert run.data.tags["dp.release"] == ("not-for-release" if audited else "ok"), run.data.tags
        assert run.data.tags["dp.streams"].startswith("os-entropy")
        assert "dp.stream_seed" not in run.data.params or run.data.params["dp.stream_seed"] == "None"


@pytest.mark.parametrize("mechanism", list(SECURE))
def test_secure_mode_runs_every_mechanism_from_fresh_entropy(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, mechanism: str
) -> None:
    _two_secure_runs(make_cfg, client, experiment_name, SECURE[mechanism])


@pytest.mark.slow  # about 10 s each: the GAN, the recommender's methods, the audits
@pytest.mark.parametrize("mechanism", list(SECURE_SLOW))
def test_secure_mode_runs_every_other_mechanism_from_fresh_entropy(
    make_cfg: Composer, client: MlflowClient, experiment_name: str, mechanism: str
) -> None:
    _two_secure_runs(make_cfg, client, experiment_name, SECURE_SLOW[mechanism])


def test_runs_that_are_not_secure_reproduce_from_their_seed(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    a, b = (train(make_cfg("train.epochs=1", "sweep.force=true")) for _ in "ab")
    assert torch.equal(_weights(a), _weights(b))
    for run in runs_of(client, experiment_name):
        assert run.data.tags["dp.release"] == "not-for-release"
        assert run.data.tags["dp.streams"].startswith("train.seed and the config hash")


def test_a_resumed_secure_run_releases_its_clipping_norm_once(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The private clipping norm is charged once because a resumed run derives the same one again: a
    secure run's checkpoint keeps its entropy (never logged), so its resumed run chooses the same C."""
    chosen: list[float] = []
    original = ClassifierRun._private_clipping_norm

    def recorded(self: ClassifierRun) -> float:
        chosen.append(original(self))
        return chosen[-1]

    monkeypatch.setattr(ClassifierRun, "_private_clipping_norm", recorded)
    cfg = make_cfg("dp.secure_mode=true", "dp.clipping=quantile", "train.epochs=2", f"train.checkpoint_dir={tmp_path}")
    train_interrupted(cfg, ClassifierRun, 2)
    resumed = train(cfg)
    assert len(chosen) == 2 and chosen[0] == chosen[1]
    [run] = runs_of(client, experiment_name)
    assert run.info.run_id == resumed.run_id and run.info.status == "FINISHED"
    assert [e.name for e in resumed.ledger.entries].count("clip_quantile") == 1


def test_shared_streams_are_refused_in_secure_mode(
    make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    with pytest.raises(ConfigError, match=r"dp.stream_seed=5 is invalid: null with dp.secure_mode=true"):
        train(make_cfg("dp.secure_mode=true", "dp.stream_seed=5"))
    assert runs_of(client, experiment_name) == []


def test_the_gan_generator_steps_public_draws_do_not_follow_the_private_batch_sizes(make_cfg: Composer) -> None:
    """The critic's fakes and ρ are as many as its Poisson batch is large: drawn from the global stream,
    they put the generator step's z and labels at a place that told the batches' sizes. Two secure runs
    (other batches) end an epoch with their public stream at the same place, and their private ones apart."""
    states = []
    for _ in "ab":
        task_run, parts, _ = _built(make_cfg(*GAN, "dp.secure_mode=true", "train.epochs=1"))
        task_run.train_epoch(1, _NoStages())
        assert isinstance(parts.generator, Generators)
        states.append({k: parts.generator[k].get_state() for k in ("public", "fakes", "sampling")})
    a, b = states
    assert torch.equal(a["public"], b["public"])
    assert not torch.equal(a["fakes"], b["fakes"]) and not torch.equal(a["sampling"], b["sampling"])


class _NoStages:
    """The runner's memory-stage log, unused here."""

    def mark(self, stage: str) -> None:
        pass

    def stepped(self) -> None:
        pass


def test_a_secure_checkpoint_without_its_entropy_is_refused(make_cfg: Composer) -> None:
    """Fresh entropy for a resumed secure run would draw a second clipping norm and other canaries, which
    the ledger charges once: a checkpoint that kept none is refused (a crafted one: dpsweep writes it)."""
    from dpsweep.config import to_config
    from dpsweep.run import checkpoint, seeds

    cfg = to_config(make_cfg("dp.secure_mode=true", "train.checkpoint_dir=ckpt"))
    plan: Any = runner._planned(cfg, torch.device("cpu"))[1]
    state = checkpoint.TrainingState(plan.config_hash, "run", 1, 23, rng={"torch": torch.get_rng_state()})
    with pytest.raises(ConfigError, match=r"train.checkpoint_dir='ckpt' is invalid: a secure run's checkpoint"):
        seeds.streams_of(cfg, plan, state, runner.distributed.Ranks())
    kept = seeds.streams_of(
        cfg, plan, dataclasses.replace(state, rng={seeds.STREAMS_KEY: "ff"}), runner.distributed.Ranks()
    )
    assert kept.secure and kept.entropy == (255,)
