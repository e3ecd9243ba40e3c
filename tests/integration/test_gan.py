"""task=gan end to end: a DP-WGAN-GP run on digits logs what the issue asks (ε per epoch from one
Poisson-subsampled Gaussian event per critic step, generator losses, sample grids, TSTR accuracy, the
memorisation share, the generator and the synthetic set), releases no un-noised statistic of the
data without saying so, stops at its budget, resumes exactly, and refuses bad input before any run."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import Composer, child_runs, run_dpsweep, run_main, straight_and_resumed
from memory_metrics import memory_bytes
from mlflow.tracking import MlflowClient

from dpsweep.config import ConfigError, flatten, identity, to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.data.loaders import DigitsConfig, build
from dpsweep.plan import prepare
from dpsweep.privacy.ledger import Accounting
from dpsweep.privacy.schedule import epsilon, poisson_schedule
from dpsweep.run.runner import train
from dpsweep.tasks.gan import synthetic, task

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)
STEPS_PER_EPOCH = 23  # ceil(1437 / 64)
QUICK = [
    "task=gan", "task.tstr_epochs=2", "task.grid_every=1", "task.memorisation_samples=200", "task.critic_width=8",
    "task.generator_width=16",
]  # fmt: skip


def _artifacts(client: MlflowClient, run_id: str, path: str = "") -> set[str]:
    found: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, f.path) if f.is_dir else {f.path}
    return found


@pytest.mark.slow
def test_a_private_gan_run_logs_its_epsilon_samples_and_scores(make_cfg: Composer, client: MlflowClient) -> None:
    cfg = make_cfg(*QUICK, "dp.noise_multiplier=1.2", "task.snapshots=2", "task.snapshot_every=1",
                   "task.memorisation_check=true")  # asked for: off by default under DP  # fmt: skip
    result = train(cfg)
    run = client.get_run(result.run_id)
    m, tags = run.data.metrics, run.data.tags

    # every critic step is one Poisson-subsampled Gaussian step of the ledger: 2 epochs of ceil(N/B)
    assert result.steps == 2 * STEPS_PER_EPOCH and tags["dp.steps"] == str(2 * STEPS_PER_EPOCH)
    [entry] = result.ledger.entries
    assert entry.params == {"noise_multiplier": 1.2, "sample_rate": 1 / STEPS_PER_EPOCH, "steps": 46}
    pld = Accounting("pld")  # the default accountant
    expected = epsilon(poisson_schedule(1437, 64), 1.2, 1e-5, epochs=2, accounting=pld).epsilon
    assert m["epsilon"] == pytest.approx(expected, rel=1e-12) and m["epsilon_pld"] == m["epsilon"]
    per_epoch = client.get_metric_history(run.info.run_id, "epsilon")
    assert [h.step for h in per_epoch] == [1, 2] and per_epoch[0].value < per_epoch[1].value
    assert [h.step for h in client.get_metric_history(run.info.run_id, "generator_loss")] == [1, 2]
    assert "critic_loss" not in m  # the critic's loss on real examples is not noised: not released with DP
    assert 0 <= m["tstr_accuracy"] <= 1 and 0 <= m["memorisation_share"] <= 1
    assert "real_accuracy" not in m  # the non-private reference belongs to dp=off runs
    assert tags["dp.release"] == "not-for-release" and tags["dp.outside_ledger"] == "memorisation_share"
    assert result.objective == "tstr_accuracy" and result.score == m["tstr_accuracy"]
    assert run.info.run_name.startswith("σ1.2-") and run.info.run_name.endswith("-digits-gan"), run.info.run_name

    # the memory stages of one critic step on exactly B examples
    for stage in ("model_load", "batch_load", "backward", "optimizer_step"):
        assert memory_bytes(m, stage) > 0
    assert tags["memory.batch"] == "exact-B"

    files = _artifacts(client, run.info.run_id)
    assert {"samples/epoch_001.png", "samples/epoch_002.png", "generator.pt", "synthetic.npz"} <= files
    assert "privacy_ledger.json" in files
    synthetic_set = np.load(client.download_artifacts(run.info.run_id, "synthetic.npz"))
    assert synthetic_set["x"].shape == (1437, 1, 28, 28)
    assert np.bincount(synthetic_set["y"]).min() >= 1437 // 10  # balanced classes
    low, high = -1.0, 1.0  # digits' normalised pixel range: the generator's output range
    assert low <= synthetic_set["x"].min() and synthetic_set["x"].max() <= high
    weights = torch.load(client.download_artifacts(run.info.run_id, "generator.pt"), weights_only=True)
    first, last = weights["mixture"]  # the generator after epochs 1 and 2: the synthetic set's mixture
    final = result.model.generator.state_dict()  # type: ignore[union-attr]
    assert set(first) == set(last) == set(final) and all(torch.equal(last[k], final[k]) for k in final)
    assert not all(torch.equal(first[k], final[k]) for k in final)
    grid = client.download_artifacts(run.info.run_id, "samples/epoch_002.png")
    with open(grid, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_non_private_gan_logs_the_reference_rows_and_its_losses(
    make_cfg: Composer, client: MlflowClient, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_cfg(*QUICK, "dp=off", "train.epochs=1", "task.memorisation_check=false")
    with caplog.at_level(logging.INFO, logger="dpsweep"):
        result = train(cfg)
    # the evaluation's classifiers say how far they are, an epoch at a time (issue 33, item 11)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluating: ")]
    epochs = int(cfg.task.tstr_epochs)
    assert [m.split("  ")[0] for m in said] == [
        *(f"evaluating: TSTR classifier epoch {e}/{epochs}" for e in range(1, epochs + 1)),
        *(f"evaluating: real-data baseline epoch {e}/{epochs}" for e in range(1, epochs + 1)),
    ], said
    run = client.get_run(result.run_id)
    m = run.data.metrics
    assert {"critic_loss", "generator_loss", "tstr_accuracy", "real_accuracy"} <= set(m)
    assert "epsilon" not in m and "memorisation_share" not in m
    assert m["real_accuracy"] > 0.5  # the cnn on the real training split, even after 2 epochs
    assert run.data.tags["dp.enabled"] == "False" and "dp.release" not in run.data.tags


@pytest.mark.slow
def test_stop_at_budget_stops_at_the_last_step_within_it(make_cfg: Composer, client: MlflowClient) -> None:
    target = 1.7  # reached after 30-40 of the 460 critic steps (2 epochs of 23)
    cfg = make_cfg(
        *QUICK, "train.epochs=20", "dp.noise_multiplier=1.2", f"dp.target_epsilon={target}",
        "task.stop_at_budget=true", "task.memorisation_check=false",
    )  # fmt: skip
    result = train(cfg)
    schedule = poisson_schedule(1437, 64)
    assert result.noise_multiplier == 1.2  # kept, not calibrated
    assert 0 < result.steps < 20 * STEPS_PER_EPOCH
    assert result.epsilon is not None and result.epsilon <= target
    one_more = epsilon(schedule, 1.2, 1e-5, steps=result.steps + 1).epsilon
    assert one_more > target  # dp-GAN's rule: the next step would have passed the budget
    run = client.get_run(result.run_id)
    last_epoch = max(h.step for h in client.get_metric_history(result.run_id, "epsilon"))
    assert last_epoch == -(-result.steps // STEPS_PER_EPOCH) < 20  # ended in the epoch the budget ran out
    assert "tstr_accuracy" in run.data.metrics  # the final evaluation ran there


@pytest.mark.slow
def test_an_interrupted_gan_run_resumes_to_the_same_generator_and_epsilon(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient, experiment_name: str
) -> None:
    args = [*QUICK, "train.epochs=2", "dp.noise_multiplier=1.2"]  # the memorisation check: off by default under DP
    args += ["task.generator_ema=0.9", "task.snapshots=2", "task.snapshot_every=1"]  # restored too
    straight, resumed = straight_and_resumed(make_cfg, client, experiment_name, args, task.GanRun, 2, tmp_path)
    run = client.get_run(resumed.run_id)  # issue 33, item 3: no un-noised statistic released by default
    assert "memorisation_share" not in run.data.metrics and "dp.outside_ledger" not in run.data.tags
    assert resumed.steps == 2 * STEPS_PER_EPOCH
    assert resumed.epsilons == straight.epsilons  # every critic step counted once, from the restored count
    for part in ("generator", "average", "snapshots"):  # the weights, their average and snapshots: restored exactly
        for name, weight in getattr(straight.model, part).state_dict().items():
            assert torch.equal(weight, getattr(resumed.model, part).state_dict()[name]), (part, name)
    assert resumed.score == straight.score


def test_the_generator_average_warms_up_and_is_what_samples() -> None:
    """task.generator_ema: decay min(ema, (1+t)/(10+t)) at generator step t, and the average samples."""
    from dpsweep.tasks.gan.models import ConditionalGan

    gan = ConditionalGan(latent_dim=4, generator_width=2, critic_width=2, num_classes=10, generator_ema=0.5)
    assert gan.average is not None and gan.sampler is gan.average
    assert not any(p.requires_grad for p in gan.average.parameters())
    start = [p.detach().clone() for p in gan.average.parameters()]
    for step, decay in enumerate([1 / 10, 2 / 11, 3 / 12, 4 / 13, 5 / 14, 6 / 15, 7 / 16, 8 / 17, 0.5, 0.5]):
        with torch.no_grad():
            for p in gan.generator.parameters():
                p.add_(1.0)
        before = [p.detach().clone() for p in gan.average.parameters()]
        gan.update_average()
        for old, new, target in zip(before, gan.average.parameters(), gan.generator.parameters(), strict=True):
            torch.testing.assert_close(new, decay * old + (1 - decay) * target)
        assert int(gan.generator_steps) == step + 1
    assert not torch.equal(start[0], next(gan.average.parameters()))
    plain = ConditionalGan(latent_dim=4, generator_width=2, critic_width=2, num_classes=10)
    assert plain.average is None and plain.sampler is plain.generator


def test_tstr_chooses_its_epoch_on_synthetic_data_only() -> None:
    """The chosen epoch and its validation accuracy do not depend on the real test split at all."""
    data = build(DigitsConfig(image_size=8))
    x = torch.stack([data.train[i][0] for i in range(400)])
    y = torch.tensor([int(data.train[i][1]) for i in range(400)])
    test_a = (x[:100], y[:100])
    test_b = (torch.randn(50, 1, 8, 8), torch.randint(0, 10, (50,)))
    recipe = synthetic.Recipe(epochs=4, lr=0.05, batch_size=32, val_fraction=0.25)

    def build_model() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

    first = synthetic.tstr_accuracy(build_model, (x, y), test_a, recipe, seed=0, device=torch.device("cpu"))
    second = synthetic.tstr_accuracy(build_model, (x, y), test_b, recipe, seed=0, device=torch.device("cpu"))
    assert (first.epoch, first.val_accuracy) == (second.epoch, second.val_accuracy)
    assert first.accuracy != second.accuracy  # the test split scores the chosen model, nothing more
    assert first.accuracy > 0.6  # linear on digits: a working classifier


def test_memorisation_share_is_one_for_copies_and_its_baseline_for_fresh_samples() -> None:
    data = build(DigitsConfig(image_size=8))
    images = torch.stack([data.train[i][0] for i in range(len(data.train))])  # type: ignore[arg-type]
    test = torch.stack([data.test[i][0] for i in range(len(data.test))])  # type: ignore[arg-type]
    train_part, fresh = images[:1000], images[1000:]
    rng = torch.Generator().manual_seed(0)
    copies = train_part[torch.randperm(1000, generator=rng)[:300]] + 1e-4  # memorised training images
    assert synthetic.memorisation_share(copies, train_part, test, samples=2000, rng=rng) > 0.99
    share = synthetic.memorisation_share(fresh, train_part, test, samples=2000, rng=rng)
    baseline = synthetic.memorisation_baseline(1000, len(test))
    assert baseline == 1000 / 1360
    assert abs(share - baseline) < 0.08  # held-out real images: nearest to any real image alike


def test_the_gans_settings_are_its_task_section_and_leave_the_classifier_identity_unchanged(
    make_cfg: Composer,
) -> None:
    classifier = to_config(make_cfg())
    assert [k for k in identity(flatten(classifier)) if k.startswith(("task.", "gan"))] == ["task.name"]
    gan = to_config(make_cfg("task=gan"))
    assert gan.task.n_critic == 5 and gan.dp.grad_sample_mode.value == "hooks"  # read by no step of the GAN's
    assert gan.task.objective == "tstr_accuracy" and classifier.task.objective == "test_accuracy"
    assert "task.n_critic" in identity(flatten(gan)) and "task.grid_every" not in identity(flatten(gan))


def test_dpsweep_plan_prices_a_gan_as_its_critic_steps(make_cfg: Composer) -> None:
    plan = prepare(to_config(make_cfg("task=gan", "train.epochs=30", "dp.noise_multiplier=1.1")), DIGITS)
    assert plan.privacy is not None and plan.steps == 30 * STEPS_PER_EPOCH
    schedule = poisson_schedule(1437, 64)
    pld = Accounting("pld")  # the default accountant
    assert plan.privacy.epsilon == epsilon(schedule, 1.1, 1e-5, epochs=30, accounting=pld).epsilon
    capped = prepare(
        to_config(make_cfg("task=gan", "train.epochs=30", "dp.target_epsilon=2", "task.stop_at_budget=true")), DIGITS
    )
    assert capped.privacy is not None and not capped.privacy.calibrated and capped.privacy.noise_multiplier == 1.0
    assert capped.steps < 30 * STEPS_PER_EPOCH and capped.privacy.epsilon <= 2
    calibrated = prepare(to_config(make_cfg("task=gan", "train.epochs=30", "dp.target_epsilon=2")), DIGITS)
    assert calibrated.privacy is not None and calibrated.privacy.calibrated and calibrated.steps == 690


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["task.gp_weight=-1"], "task.gp_weight", "λ >= 0"),
        (["task.n_critic=0"], "task.n_critic", "1 or more critic steps"),
        (["task.generator_ema=1"], "task.generator_ema", "a decay in [0, 1)"),
        (["task.snapshots=0"], "task.snapshots", "a positive integer"),
        (["task.snapshot_every=0"], "task.snapshot_every", "a positive integer"),
        # the critic's own step (dp.engine=critic) states what it takes; Opacus's modes are not asked
        (
            ["dp.clipping=adaptive"],
            "dp.clipping",
            "fixed with dp.mechanism=dpsgd at dp.unit=example (its engine: critic)",
        ),
        (
            ["train.physical_batch_size=8"],
            "train.physical_batch_size",
            "(its engine: critic): a critic step is one pass",
        ),
        (["dp.engine=opacus"], "dp.engine", "critic with task=gan"),
        (["dataset.image_size=32"], "dataset.image_size", "28 with task=gan"),
        (["dataset=cifar10"], "dataset.name", "a single-channel dataset"),
        (["task.stop_at_budget=true"], "task.stop_at_budget", "with dp.target_epsilon set"),
        (["model=vgg16_frozen"], "model.name", "cnn with task=gan"),
        (["dp.target_epsilon=0.01", "task.stop_at_budget=true"], "dp.target_epsilon", "at least one critic step"),
    ],
)
def test_bad_gan_input_is_refused_before_training(
    make_cfg: Composer, overrides: list[str], key: str, allowed: str
) -> None:
    from dpsweep.data.facts import described, official_facts

    cfg = to_config(make_cfg("task=gan", *overrides))
    facts = described(cfg.dataset) or official_facts(cfg.dataset)  # as dpsweep-plan reads them
    with pytest.raises(ConfigError) as err:
        prepare(cfg, facts)
    assert err.value.key == key and allowed in str(err.value), str(err.value)


def test_the_released_generator_is_one_input_module() -> None:
    """What MLflow logs as the run's model: rows of [z | class] to images, without the critic."""
    from dpsweep.tasks.gan.models import CodeGenerator, Generator

    generator = Generator(latent_dim=8, width=4, num_classes=10)
    code = torch.cat([torch.randn(3, 8), torch.tensor([[0.0], [4.0], [9.0]])], dim=1)
    out = CodeGenerator([generator])(code)
    assert out.shape == (3, 1, 28, 28) and CodeGenerator([generator]).code_width == 9
    assert torch.equal(out, generator(code[:, :8], torch.tensor([0, 4, 9])))
    buffer = io.BytesIO()
    torch.save(CodeGenerator([generator]).state_dict(), buffer)
    assert not any("critic" in k for k in CodeGenerator([generator]).state_dict())
    # a mixture (task.snapshots > 1): the last column picks the member
    other = Generator(latent_dim=8, width=4, num_classes=10)
    mixed = CodeGenerator([generator, other])
    assert mixed.code_width == 10
    rows = mixed(torch.cat([code, torch.tensor([[1.0], [0.0], [1.0]])], dim=1))
    assert torch.equal(rows[1:2], generator(code[1:2, :8], torch.tensor([4])))
    assert torch.equal(rows[[0, 2]], other(code[[0, 2], :8], torch.tensor([0, 9])))


def test_snapshots_keep_the_last_generators_and_the_synthetic_set_mixes_them() -> None:
    """task.snapshots: a ring of the sampler's past weights; the synthetic set draws from each equally."""
    from dpsweep.tasks.gan.models import ConditionalGan

    gan = ConditionalGan(latent_dim=4, generator_width=2, critic_width=2, num_classes=10, snapshots=2)
    assert gan.mixture == [gan.sampler]  # none taken yet
    weights = []
    for _ in range(3):
        with torch.no_grad():
            for p in gan.generator.parameters():
                p.add_(1.0)
        gan.take_snapshot()
        weights.append([p.detach().clone() for p in gan.generator.parameters()])
    assert int(gan.snapshots_taken) == 3 and len(gan.mixture) == 2
    for member, kept in zip(gan.mixture, weights[1:], strict=True):  # the last two, oldest first
        assert all(torch.equal(a, b) for a, b in zip(member.parameters(), kept, strict=True))
    rng = torch.Generator().manual_seed(0)
    x, y = synthetic.sample(gan.mixture, 101, 10, rng)
    assert x.shape == (101, 1, 28, 28) and sorted(torch.bincount(y).tolist()) == [10] * 9 + [11]
    rng.manual_seed(0)  # the same draws by hand: labels, then each member's z for positions k, k+2, ...
    labels = (torch.arange(101) % 10)[torch.randperm(101, generator=rng)]
    assert torch.equal(y, labels)
    for k, member in enumerate(gan.mixture):
        z = torch.randn(len(range(k, 101, 2)), 4, generator=rng)
        with torch.no_grad():
            torch.testing.assert_close(x[k::2], member.eval()(z, labels[k::2]))


@pytest.mark.slow
def test_dpsweep_m_sweeps_gans_and_dpsweep_plan_prices_them(tmp_path: Path) -> None:
    from dpsweep.cli import plan

    tiny = [a for a in QUICK if a != "task.grid_every=1"] + ["tracking.log_model=false"]
    planned = run_main(plan.main, *tiny, "train.epochs=30", "dp.target_epsilon=2", "task.stop_at_budget=true", "--json")
    assert planned.returncode == 0, planned.stderr
    [row] = json.loads(planned.stdout)
    assert row["steps"] < 30 * STEPS_PER_EPOCH and row["epsilon"] <= 2 and row["noise_multiplier"] == 1.0

    small = "dataset.test_fraction=0.75"  # 449 training images: the sweep, not the GAN, is under test
    swept = run_dpsweep("-m", *tiny, small, "train.epochs=1", "dp=off,dpsgd", "train.progress=false")
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert swept.stdout.count("tstr_accuracy=") >= 2, swept.stdout  # each job's line names the task's objective
    runs = child_runs(tmp_path)
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    assert all("tstr_accuracy" in r.data.metrics and r.data.tags["task.name"] == "gan" for r in runs)


@pytest.mark.slow
def test_a_gan_trains_on_mnist_files_in_their_real_format(
    tmp_path: Path, make_cfg: Composer, client: MlflowClient
) -> None:
    """MNIST through torchvision's real loader (tiny idx files): the generator draws in MNIST's normalised range."""
    from fabricate import fabricate_mnist

    from dpsweep.data.loaders import value_range

    fabricate_mnist(tmp_path, n_train=40, n_test=20)
    cfg = make_cfg(
        *QUICK, "dataset=mnist", f"dataset.root={tmp_path}", "train.batch_size=8", "train.epochs=1",
        "dp.noise_multiplier=1.0",
    )  # fmt: skip
    result = train(cfg)
    assert result.steps == 5 and 0 <= result.score <= 1  # ceil(40 / 8) critic steps
    low, high = value_range("mnist")
    assert (low, high) == pytest.approx(((0 - 0.1307) / 0.3081, (1 - 0.1307) / 0.3081))
    samples = np.load(client.download_artifacts(result.run_id, "synthetic.npz"))
    assert samples["x"].shape == (40, 1, 28, 28)
    assert low - 1e-5 <= samples["x"].min() and samples["x"].max() <= high + 1e-5
