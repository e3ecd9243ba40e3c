"""``task=gan``: private synthetic data from a conditional DP-WGAN-GP (dp-GAN), scored by TSTR accuracy.

    dpsweep task=gan dp.noise_multiplier=1.0 train.epochs=60
    dpsweep experiment=dpgan_digits                      # the tuned preset (see its header)

dp-GAN (Zhang, Ji & Wang 2018, "Differentially Private Releasing via Deep Generative Model", Alg. 1)
on WGAN-GP (Gulrajani et al. 2017). Each **critic step** takes a Poisson sample of the training set
at q = 1/ceil(N/B) (Opacus's loader convention, so an epoch is ceil(N/B) critic steps and ε per
epoch is DP-SGD's), pairs each real example (x_i, y_i) with a fake G(z_i, y_i) and ρ_i ~ U[0, 1],
and steps Adam on the noisy mean of the clipped per-example gradients of the whole critic loss,
gradient penalty included (``dpsweep.tasks.gan.critic``): one Poisson-subsampled Gaussian event in the run's
ledger per critic step. Every ``task.n_critic`` critic steps the **generator** takes a plain Adam
step on -D(G(z, y)) with public random labels: it never reads data, so it is post-processing.

Without DP (``dp=off``) the critic steps on the mean gradient of shuffled batches of B.

Evaluation (``dpsweep.tasks.gan.synthetic``) at the end: a labelled synthetic set of N examples, the TSTR
accuracy of the model group's classifier trained on it (chosen on a synthetic split, scored on the
real test split), the memorisation share, and, without DP only, the same classifier trained on the
real training split (``real_accuracy``: the reference row). Artifacts: a 10 x 10 sample grid every
``task.grid_every`` epochs and at the end (``samples/epoch_NNN.png``), the generator's weights
(``generator.pt``) and the synthetic set (``synthetic.npz``); the run's ``model`` is the generator.

With ``task.snapshots`` = K > 1 the generator (its moving average with ``task.generator_ema``) is
kept at the end of every ``task.snapshot_every``-th epoch and of the last, in a ring of K; the
synthetic set, TSTR, ``generator.pt`` (``{"mixture": [...]}``) and the model (rows [z | class |
member]) are then the uniform mixture of the kept ones. Post-processing: they are functions of the
critic's noisy steps alone.
"""

from __future__ import annotations

import copy
import functools
import io
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dpsweep.config import GanTaskConfig
from dpsweep.data import loaders, resident
from dpsweep.mechanisms import private_step
from dpsweep.mechanisms.private_step import PrivateStep, Score, TrainingSet
from dpsweep.models import classifiers
from dpsweep.privacy import ledger
from dpsweep.privacy.streams import Purpose
from dpsweep.tasks import TASKS, Checkpointed, Marks, RunInputs, Stages
from dpsweep.tasks.gan import synthetic
from dpsweep.tasks.gan.critic import CriticStep, critic_gradient, private_critic_release
from dpsweep.tasks.gan.models import CodeGenerator, ConditionalGan
from dpsweep.tracking import Tracker

EVAL_SEED_OFFSET = 7_919  # the evaluation's draws (grids, synthetic set, TSTR) use their own generators
log = logging.getLogger("dpsweep")


def _progress(what: str, epochs: int) -> Callable[[int, float], None]:
    """A line per epoch of an evaluation classifier (about 90 s in all on digits), so that the end of a
    GAN run is not silent (issue 33, item 11)."""
    started = time.perf_counter()

    def told(epoch: int, held_out_accuracy: float) -> None:
        log.info(
            f"evaluating: {what} epoch {epoch}/{epochs}  held_out_accuracy={held_out_accuracy:.4f}  "
            f"({time.perf_counter() - started:.1f} s)"
        )

    return told


class GanTask:
    def build(self, inputs: RunInputs) -> GanRun:
        return GanRun(inputs)


TASKS.register("gan")(GanTask())


class GanRun:
    """One DP-WGAN-GP run (see :class:`dpsweep.tasks.TaskRun`)."""

    # The critic's loss on the Poisson batches reads real examples without noise: not released with DP.
    private_metrics = ("critic_loss",)
    private_stages = False  # measured on exactly B examples, a public shape

    def __init__(self, inputs: RunInputs) -> None:
        self.inputs, self.cfg, self.device = inputs, inputs.cfg, inputs.device
        g = self.cfg.task
        assert isinstance(g, GanTaskConfig)  # this task's own settings (task.*)
        self.settings = g
        self.num_classes = inputs.data.num_classes
        self.gan = ConditionalGan(
            g.latent_dim, g.generator_width, g.critic_width, self.num_classes,
            loaders.value_range(self.cfg.dataset.name), g.generator_ema, g.snapshots,
        )  # fmt: skip
        self.run: Tracker | None = None
        self.noise: torch.Generator | None = None  # the critic's noise (a private stream), with DP
        self.fakes: torch.Generator | None = None  # the critic's fakes and ρ (a private stream), with DP
        self.public: torch.Generator | None = None  # the generator step's z and labels, with DP (else torch's)
        self.wrapper: TrainingSet | None = None  # what the training set is replaced by (a black-box audit's)
        self.wrappers: list[private_step.StepWrapper] = []  # what wraps the critic's private step

    def tags(self) -> dict[str, Any]:
        tags: dict[str, Any] = {
            "gan.generator_params": classifiers.trainable_parameters(self.gan.generator),
            "gan.critic_params": classifiers.trainable_parameters(self.gan.critic),
            "model.trainable_params": classifiers.trainable_parameters(self.gan),
        }
        if self.cfg.dp.enabled and self.settings.checks_memorisation(private=True):
            # memorisation_share reads the training images without noise: a release ε does not cover
            tags |= {"dp.release": "not-for-release", "dp.outside_ledger": "memorisation_share"}
        return tags

    def wrap_training_set(self, wrapper: TrainingSet) -> None:
        self.wrapper = wrapper

    def private_step(self) -> PrivateStep:
        """The critic's private step: its trainable parameters, at the rate of its Poisson batches."""
        batches = self.batches
        assert self.step is not None and isinstance(batches, resident.PoissonBatches), "a DP run, started"
        params = {k: p for k, p in self.gan.critic.named_parameters() if p.requires_grad}
        return PrivateStep(params, self.step.max_grad_norm, lambda: batches.sample_rate, None, self.wrappers)

    def example_score(self) -> Score:
        """The final critic's D(x, y), which training raises on the real examples it saw (on the critic the
        ledger covers, not the generator)."""
        critic = self.gan.critic.eval()
        return lambda x, y: critic(x, y).flatten()

    def start(self, run: Tracker) -> Checkpointed:
        cfg, device, g = self.cfg, self.device, self.settings
        self.run = run
        self.gan.to(device)
        self.optimizer = torch.optim.Adam(
            [
                {"params": list(self.gan.critic.parameters()), "lr": g.critic_lr},
                {"params": list(self.gan.generator.parameters()), "lr": g.generator_lr},
            ],
            betas=(float(g.betas[0]), float(g.betas[1])),
        )
        train = self.inputs.data.train
        if self.wrapper is not None:  # e.g. a black-box audit's canaries in and out; sampled at the plan's q
            train = self.wrapper.training_set(train)
        x, y = (t.to(device) for t in resident.materialize(train))
        self.train_x, self.train_y = x, y
        self.generator: torch.Generator | resident.Generators
        self.batches: resident.PoissonBatches | resident.ShuffledBatches
        if self.inputs.plan.privacy is not None:  # the critic's batches, noise and fakes: private streams of their own
            q, streams = self.inputs.plan.privacy.poisson_rate, self.inputs.streams
            sampling = resident.private_generator(device, streams.seed(Purpose.sampling))
            self.noise = resident.private_generator(device, streams.seed(Purpose.noise))
            # as many fakes and ρ as the private batch has: drawn apart from the generator step's public draws,
            # whose place in their stream then tells nothing of the batches' sizes
            self.fakes = resident.private_generator(device, streams.seed(Purpose.mechanism))
            self.public = resident.device_generator(device, cfg.train.seed)
            self.generator = resident.Generators(sampling=sampling, noise=self.noise, fakes=self.fakes,
                                                    public=self.public)  # fmt: skip
            self.batches = resident.PoissonBatches(x, y, sample_rate=q, device=device, generator=sampling)
        else:
            self.generator = resident.device_generator(device, cfg.train.seed)  # public shuffles
            self.batches = resident.ShuffledBatches(
                x, y, batch_size=cfg.train.batch_size, device=device, generator=self.generator
            )
        self.draw: Callable[..., tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]] = (
            functools.partial(private_critic_release, generator=self.noise)
        )
        privacy = self.inputs.plan.privacy
        # over the config's B, a public constant (issue 58, item 5; cf. arXiv 2605.15648), not q·N_train, a
        # function of the private N: post-processing, the rate q and the ledger unchanged
        self.step = None if privacy is None else CriticStep(
            g.gp_weight, cfg.dp.max_grad_norm, privacy.noise_multiplier, float(cfg.train.batch_size)
        )  # fmt: skip
        return Checkpointed(self.gan, self.optimizer, None, self.generator)

    @property
    def critic_steps(self) -> int:
        return int(self.gan.critic_steps)

    def done(self) -> bool:
        """Every planned critic step is taken (fewer than train.epochs' with task.stop_at_budget)."""
        return self.critic_steps >= self.inputs.plan.steps

    # ------------------------------------------------------------------ training
    def _critic_step(self, x: torch.Tensor, y: torch.Tensor, stages: Marks) -> torch.Tensor:
        """One critic step on the batch (x, y): the examples' losses ℓ_i (un-noised)."""
        gan, g = self.gan, self.settings
        self.optimizer.zero_grad(set_to_none=True)
        stages.mark("batch_load")
        with torch.no_grad():
            fake = gan.generator(torch.randn(len(y), g.latent_dim, device=self.device, generator=self.fakes), y)
        rho = torch.rand(len(y), 1, 1, 1, device=self.device, generator=self.fakes)
        stages.mark("forward")
        if self.step is not None:  # the wrappers' rows clipped and noised with the examples'
            extra = private_step.extra_units(self.wrappers, self.critic_steps)
            clipped, grads, losses = self.draw(gan.critic, x, y, fake, rho, self.step, extra=extra)
            release = private_step.Release(
                self.critic_steps, clipped, grads, self.step.expected_batch_size, batch_units=len(y)
            )
            private_step.show(self.wrappers, release)
        else:
            grads, losses = critic_gradient(gan.critic, x, y, fake, rho, g.gp_weight)
        stages.mark("backward")
        for name, p in gan.critic.named_parameters():
            p.grad = grads[name]
        self.optimizer.step()  # Adam skips the generator: its gradients are None
        private_step.stepped(self.wrappers, self.critic_steps)
        stages.mark("optimizer_step")
        return losses

    def _generator_step(self) -> float:
        """One generator step on -D(G(z, y)), y uniform over the classes (public): post-processing."""
        gan, g = self.gan, self.settings
        self.optimizer.zero_grad(set_to_none=True)
        size = self.cfg.train.batch_size
        labels = torch.randint(0, self.num_classes, (size,), device=self.device, generator=self.public)
        z = torch.randn(size, g.latent_dim, device=self.device, generator=self.public)
        loss = -gan.critic(gan.generator(z, labels), labels).mean()
        loss.backward()
        for p in gan.critic.parameters():
            p.grad = None  # the critic's step is the private one only
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        gan.update_average()
        return float(loss.detach())

    def train_epoch(self, epoch: int, stages: Stages) -> dict[str, float]:
        critic_sum, seen, generator_losses = torch.zeros((), device=self.device), 0, []
        for x, y in self.batches:
            if self.done():
                break
            losses = self._critic_step(x, y, stages)
            self.gan.critic_steps += 1
            stages.stepped()
            critic_sum += losses.sum()
            seen += len(losses)
            if self.critic_steps % self.settings.n_critic == 0:
                generator_losses.append(self._generator_step())
        if epoch % self.settings.snapshot_every == 0 or self.done():  # the last epoch's generator always joins
            self.gan.take_snapshot()
        metrics = {"critic_loss": float(critic_sum) / max(seen, 1), "critic_steps": float(self.critic_steps)}
        if generator_losses:
            metrics["generator_loss"] = float(np.mean(generator_losses))
        return metrics

    # ------------------------------------------------------------------ evaluation
    def _rng(self, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.train.seed * 100_003 + EVAL_SEED_OFFSET + salt)

    def evaluate(self, epoch: int, final: bool) -> dict[str, float]:
        """Sample grids every task.grid_every epochs and at the end; at the end, the synthetic set and its scores."""
        assert self.run is not None
        if final or epoch % self.settings.grid_every == 0:
            grid = synthetic.image_grid(self.gan.sampler, self.num_classes, self._rng(epoch), self.device)
            self.run.log_image(grid, f"samples/epoch_{epoch:03d}.png")
        if not final:
            return {}
        return self._final_scores()

    def _final_scores(self) -> dict[str, float]:
        assert self.run is not None
        cfg, g, data = self.cfg, self.settings, self.inputs.data
        n = data.n_train
        x, y = synthetic.sample(self.gan.mixture, n, self.num_classes, self._rng(-1), self.device)
        test = resident.materialize(data.test)
        recipe = synthetic.Recipe(g.tstr_epochs, g.tstr_lr, g.tstr_batch_size, g.tstr_val_fraction)

        def classifier() -> torch.nn.Module:
            return classifiers.build(cfg.model, data.input_shape, self.num_classes)

        tstr = synthetic.tstr_accuracy(
            classifier, (x, y), test, recipe, cfg.train.seed, self.device, _progress("TSTR classifier", recipe.epochs)
        )
        scores = {"tstr_accuracy": tstr.accuracy, "tstr_val_accuracy": tstr.val_accuracy, "tstr_epoch": tstr.epoch}
        real = (self.train_x.cpu(), self.train_y.cpu())
        if g.checks_memorisation(private=cfg.dp.enabled):
            scores["memorisation_share"] = synthetic.memorisation_share(
                x, real[0], test[0], g.memorisation_samples, self._rng(-2)
            )
            scores["memorisation_baseline"] = synthetic.memorisation_baseline(len(real[1]), len(test[1]))
        if not cfg.dp.enabled:  # the reference row: the same recipe on the real training split (non-private)
            scores["real_accuracy"] = synthetic.tstr_accuracy(
                classifier, real, test, recipe, cfg.train.seed, self.device,
                _progress("real-data baseline", recipe.epochs),
            ).accuracy  # fmt: skip
        self._log_artifacts(x, y)
        return scores

    def _log_artifacts(self, x: torch.Tensor, y: torch.Tensor) -> None:
        assert self.run is not None
        with tempfile.TemporaryDirectory(prefix="dpsweep-gan-") as tmp:
            weights, samples = Path(tmp) / "generator.pt", Path(tmp) / "synthetic.npz"
            members = [{k: v.cpu() for k, v in g.state_dict().items()} for g in self.gan.mixture]
            torch.save(members[0] if len(members) == 1 else {"mixture": members}, weights)
            np.savez_compressed(samples, x=x.numpy().astype(np.float32), y=y.numpy().astype(np.int64))
            self.run.log_file(weights)
            self.run.log_file(samples)

    # ------------------------------------------------------------------ memory and probes
    def _exact_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Exactly train.batch_size training examples (a Poisson batch's size is private; B is not)."""
        pick = torch.randperm(len(self.train_y), generator=torch.Generator().manual_seed(self.cfg.train.seed))
        pick = pick[: self.cfg.train.batch_size].to(self.device)
        return self.train_x[pick], self.train_y[pick]

    def memory_iteration(self, stages: Marks) -> None:
        rng = torch.get_rng_state(), torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        drawn = self.generator.get_state()  # the critic's noise: the step is undone, its draws too
        saved = io.BytesIO()  # as bytes, not tensors: the CPU twin's census would count a copy held as tensors
        torch.save(self.gan.state_dict(), saved)
        optimizer_state = copy.deepcopy(self.optimizer.state_dict())
        self._critic_step(*self._exact_batch(), stages)
        self.optimizer.zero_grad(set_to_none=True)
        saved.seek(0)
        self.gan.load_state_dict(torch.load(saved, map_location=self.device, weights_only=True))
        self.optimizer.load_state_dict(optimizer_state)
        self.generator.set_state(drawn)
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state_all(rng[1])

    def probe(self, stages: Stages) -> dict[str, float]:
        """One critic step on exactly train.batch_size examples."""
        self._critic_step(*self._exact_batch(), stages)
        stages.stepped()
        return {}

    # ------------------------------------------------------------------ what the run releases
    def released_model(self) -> tuple[torch.nn.Module, np.ndarray]:
        """The generator, or the mixture that made the synthetic set (the critic, trained on data, is
        not released), as a one-input module: a row is [z | class] (a mixture: [z | class | member])."""
        released = CodeGenerator([classifiers.released_copy(g) for g in self.gan.mixture])
        return released, np.zeros((1, released.code_width), dtype=np.float32)

    def trained_model(self) -> torch.nn.Module:
        return self.gan.eval()

    def privacy_ledger(self) -> ledger.Ledger:
        privacy = self.inputs.plan.privacy
        if privacy is None:
            return ledger.Ledger()
        return ledger.from_history([(privacy.noise_multiplier, privacy.poisson_rate, self.critic_steps)])

    def params(self) -> dict[str, Any]:
        return {}
