"""The fused DP step (dpsweep.mechanisms.fused): its clipped sum is Opacus hooks' on the same batch (the cnn,
the mlp and the cached VGG16 head), padding adds nothing, a batch over the bound takes more passes and
loses no example, its noise is N(0, σ²C²) over the divisor, its default bound is the documented one, and
a model it cannot run is refused by layer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import Composer
from mlflow.tracking import MlflowClient
from scipy import stats
from torch import Tensor, nn

from dpsweep.config import CNNConfig, DPConfig, MLPConfig, SGDConfig, VGG16FrozenConfig, to_config
from dpsweep.data import gathered
from dpsweep.data.users import clip_factors
from dpsweep.errors import InputError
from dpsweep.mechanisms import fused
from dpsweep.mechanisms.opacus_engine import make_private
from dpsweep.models import classifiers
from dpsweep.models.optimizers import build_optimizer

C = 0.5  # small enough that most rows are clipped, large enough that some are not


def _cnn() -> tuple[nn.Module, Tensor]:
    return classifiers.build(CNNConfig(hidden_units=16), (1, 28, 28), 10), torch.randn(24, 1, 28, 28)


def _mlp() -> tuple[nn.Module, Tensor]:
    return classifiers.build(MLPConfig(), (1, 8, 8), 10), torch.randn(24, 1, 8, 8)


def _head() -> tuple[nn.Module, Tensor]:
    vgg = classifiers.build(VGG16FrozenConfig(hidden_units=16, pretrained=False), (3, 32, 32), 10)
    assert isinstance(vgg, classifiers.FrozenVGG16)
    return vgg.cached_head((512, 1, 1)), torch.randn(24, 512)


MODELS = {"cnn": _cnn, "mlp": _mlp, "vgg16_head": _head}


def _opacus_clipped_sum(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Opacus hooks' clipped sum of the batch (DPOptimizer.clip_and_accumulate's summed_grad), flat."""
    model = copy.deepcopy(model)
    optimizer = build_optimizer(SGDConfig(), model)
    rows = torch.utils.data.TensorDataset(x, y)
    loader = gathered.loader(rows, len(y), shuffle=False, generator=torch.Generator().manual_seed(0))
    dp = DPConfig(noise_multiplier=0.0, max_grad_norm=C)
    _, private, dp_optimizer, criterion, _ = make_private(dp, 0.0, C, model, optimizer, loader, nn.CrossEntropyLoss())
    criterion(private(x), y).backward()
    dp_optimizer.clip_and_accumulate()
    return torch.cat([p.summed_grad.flatten() for p in dp_optimizer.params])


@pytest.mark.parametrize("name", list(MODELS))
def test_the_clipped_sum_is_opacus_hooks(name: str) -> None:
    torch.manual_seed(0)
    model, x = MODELS[name]()
    y = torch.randint(0, 10, (len(x),))
    step = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=32, mode=None)
    ours, theirs = step.clipped_sum(x, y), _opacus_clipped_sum(model, x, y)
    assert step.way == ("vmap" if name == "cnn" else "linear")
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    norms = torch.linalg.vector_norm(theirs)
    assert 0 < norms <= C * len(y) + 1e-4  # each row adds at most C


@pytest.mark.parametrize("name", list(MODELS))
def test_the_noised_update_is_opacus_hooks_with_the_same_noise(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole update, (clipped sum + N(0, σ²C²)) / Opacus's expected batch size, against Opacus's
    ``DPOptimizer.pre_step`` (clip, add_noise, scale_grad) given the very normals the fused step drew:
    the same scale of noise, the same divisor, in each parameter's place."""
    import opacus.optimizers.optimizer as opacus_optimizer

    torch.manual_seed(4)
    model, x = MODELS[name]()
    y = torch.randint(0, 10, (len(x),))
    sigma, divisor = 1.3, float(len(y))  # one batch of all the rows: Opacus's expected batch size is len(y)
    step = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=32, mode=None)
    ours = step.gradient(x, y, noise_multiplier=sigma, divisor=divisor, generator=torch.Generator().manual_seed(9))
    flat = torch.cat([g.flatten() for g in ours.values()])
    drawn = torch.normal(0.0, sigma * C / divisor, flat.shape, generator=torch.Generator().manual_seed(9))
    normals = iter(torch.split(drawn * divisor / (sigma * C), [p.numel() for p in step.params.values()]))

    def the_same_normals(std: float, reference: Tensor, generator: object = None, secure_mode: bool = False) -> Tensor:
        return std * next(normals).view_as(reference)

    monkeypatch.setattr(opacus_optimizer, "_generate_noise", the_same_normals)
    private_model = copy.deepcopy(model)
    rows = torch.utils.data.TensorDataset(x, y)
    loader = gathered.loader(rows, len(y), shuffle=False, generator=torch.Generator().manual_seed(0))
    dp = DPConfig(noise_multiplier=sigma, max_grad_norm=C)
    _, private, optimizer, criterion, _ = make_private(
        dp, sigma, C, private_model, build_optimizer(SGDConfig(), private_model), loader, nn.CrossEntropyLoss()
    )
    criterion(private(x), y).backward()
    assert optimizer.expected_batch_size == divisor
    optimizer.pre_step()
    theirs = torch.cat([p.grad.flatten() for p in optimizer.params])
    assert next(normals, None) is None  # every normal used, one parameter after another
    torch.testing.assert_close(flat, theirs, rtol=1e-4, atol=1e-6)
    assert torch.linalg.vector_norm(flat - drawn) <= C + 1e-4  # the clipped mean moved it by at most C·B/B


@pytest.mark.parametrize("name", ["cnn", "mlp"])
def test_padding_adds_nothing_and_a_larger_batch_takes_more_passes(name: str) -> None:
    torch.manual_seed(1)
    model, x = MODELS[name]()
    y = torch.randint(0, 10, (len(x),))
    one = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=40, mode=None)
    unpadded = one.clipped_sum(x, y).clone()  # eager: the 24 rows as they are
    one.padded = True  # as a compiled pass does: 24 rows and 16 of padding
    whole = one.clipped_sum(x, y)
    assert one.passes == 2
    torch.testing.assert_close(whole, unpadded, rtol=1e-4, atol=1e-6)
    split = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=7, mode=None)
    split.padded = True
    parts = split.clipped_sum(x, y)  # 24 rows in passes of 7 (the last padded): nothing truncated
    assert split.passes == math.ceil(len(y) / 7)
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-6)
    # a row of weight 0 adds exactly nothing, whatever it holds
    garbage = torch.cat([x[:3], 1e3 * torch.randn_like(x[:5])])
    labels = torch.cat([y[:3], torch.randint(0, 10, (5,))])
    masked = one._clipped_sum(one.params, one.buffers, garbage, labels, torch.tensor([1.0] * 3 + [0.0] * 5))
    torch.testing.assert_close(masked, one.clipped_sum(x[:3], y[:3]), rtol=1e-4, atol=1e-6)


def test_the_noise_is_sigma_c_over_the_divisor() -> None:
    torch.manual_seed(2)
    model = classifiers.build(MLPConfig(hidden_units=128), (1, 28, 28), 10)  # 101,770 parameters
    step = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=8, mode=None)
    empty_x, empty_y = torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long)
    assert torch.count_nonzero(step.clipped_sum(empty_x, empty_y)) == 0  # an empty Poisson batch: only noise
    grads = step.gradient(
        empty_x, empty_y, noise_multiplier=1.5, divisor=4.0, generator=torch.Generator().manual_seed(0)
    )
    noise = torch.cat([g.flatten() for g in grads.values()])
    assert set(grads) == {k for k, p in model.named_parameters() if p.requires_grad}
    assert len(noise) > 50_000, len(noise)
    assert noise.std().item() == pytest.approx(1.5 * C / 4.0, rel=0.02)
    assert abs(noise.mean().item()) < 0.02 * 1.5 * C / 4.0


@pytest.mark.parametrize("batch_size", [1, 8, 16, 64, 100, 256, 1000])
def test_the_default_bound_is_the_documented_one(batch_size: int) -> None:
    p = fused.default_pad_to(batch_size)
    assert p >= batch_size and p % 8 == 0
    assert stats.poisson.sf(p, batch_size) <= fused.MAX_SECOND_PASS  # a second pass in at most 5% of the steps
    smaller = p - 8
    if smaller >= batch_size:  # the bound is not larger than needed when a smaller one needs few second passes
        rows = [q * (1 + sum(stats.poisson.sf(k * q, batch_size) for k in range(1, 50))) for q in (smaller, p)]
        assert stats.poisson.sf(smaller, batch_size) > fused.MAX_SECOND_PASS or rows[1] <= rows[0]
    assert fused.default_pad_to(64) == 80 and fused.default_pad_to(256) == 288


def test_a_bound_below_b_and_a_model_that_mixes_rows_are_refused() -> None:
    with pytest.raises(InputError) as err:
        fused.pad_bound(63, 64)
    assert err.value.key == "dp.pad_to" and "at least train.batch_size=64" in str(err.value)
    assert fused.pad_bound(None, 64) == 80 and fused.pad_bound(64, 64) == 64
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(InputError) as err:
        fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=1.0, pad_to=8, mode=None)
    assert err.value.key == "dp.engine" and "'1' (BatchNorm1d)" in str(err.value)


def test_a_model_that_mixes_rows_is_refused_before_a_sweep_launches_any_job(
    make_cfg: Composer,
    client: MlflowClient,
    experiment_name: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model the fused step cannot run (here the mlp given a BatchNorm, as a user's own model might
    have) stops the sweep in its preflight: exit 2, the layer named, no job and no run."""
    from dpsweep.launchers.preflight import preflight
    from dpsweep.plan import dataset_facts, prepare

    def mlp_with_batchnorm(cfg: MLPConfig, shape: tuple[int, int, int], classes: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), 8), nn.BatchNorm1d(8), nn.Linear(8, classes))

    monkeypatch.setitem(classifiers.MODELS._entries, "mlp", mlp_with_batchnorm)
    monkeypatch.setattr(fused, "_PLANNED", set())  # the real mlp may have passed in this process
    job = ["model=mlp", "dp.engine=fused", "launcher=local"]
    cfg = make_cfg(*job)
    with pytest.raises(SystemExit) as ended:
        preflight([cfg], [job])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "dp.engine='fused' is invalid" in err and "'2' (BatchNorm1d)" in err, err
    assert client.get_experiment_by_name(experiment_name) is None  # not even its experiment: no run
    typed = to_config(make_cfg("model=mlp", "dp.grad_sample_mode=hooks"))
    prepare(typed, dataset_facts(typed)[0])  # the check is the fused step's alone


@pytest.mark.slow
def test_the_compiled_pass_equals_the_eager_one() -> None:
    """torch.compile (inductor, on the CPU here) gives the eager pass's sum: the vmap way and the linear tail."""
    torch.manual_seed(3)
    for make in (_cnn, _mlp):
        model, x = make()
        y = torch.randint(0, 10, (len(x),))
        eager = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=32, mode=None)
        compiled = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=32, mode="default")
        expected = eager.clipped_sum(x, y).clone()
        torch.testing.assert_close(compiled.clipped_sum(x, y), expected, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(compiled.clipped_sum(x[:20], y[:20]), eager.clipped_sum(x[:20], y[:20]),
                                   rtol=1e-4, atol=1e-6)  # fmt: skip
        extra, _ = _dirac(eager, eager.names[-1], k=3)  # canaries: rows of the compiled pass too
        torch.testing.assert_close(_with_extra(compiled, x, y, extra), _with_extra(eager, x, y, extra),
                                   rtol=1e-4, atol=1e-6)  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (benchmarks/fused_check.py on one)")
def test_the_linear_pass_captured_as_a_cuda_graph_equals_the_eager_one() -> None:
    torch.manual_seed(0)
    model = classifiers.build(MLPConfig(hidden_units=32), (1, 28, 28), 10).cuda()
    eager = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=16, mode=None)
    captured = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=16, mode=fused.CUDA_GRAPHS)
    assert captured.linear is not None and captured.linear.captured and not captured.padded
    for rows in (11, 16, 29, 11):  # short, full, two passes; then after the parameters moved in place
        if rows == 11 and captured.passes:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=0.1)
        x, y = torch.randn(rows, 1, 28, 28, device="cuda"), torch.randint(0, 10, (rows,), device="cuda")
        torch.testing.assert_close(captured.clipped_sum(x, y), eager.clipped_sum(x, y), rtol=1e-4, atol=1e-6)
        extra, _ = _dirac(eager, eager.names[-1], k=rows % 5 + 1)  # canaries: rows of the captured pass (its 2nd graph)
        torch.testing.assert_close(_with_extra(captured, x, y, extra), _with_extra(eager, x, y, extra),
                                   rtol=1e-4, atol=1e-6)  # fmt: skip


def _user_batch(n_users: int, most: int, x: Tensor, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """A UserBatch's rows: users of 1..most examples each (segments 0..n_users-1, non-decreasing)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, most + 1, (n_users,), generator=g)
    segment = torch.repeat_interleave(torch.arange(n_users), sizes)
    rows = torch.randint(len(x), (len(segment),), generator=g)
    return x[rows], torch.randint(0, 10, (len(segment),), generator=g), segment


@pytest.mark.parametrize("name", list(MODELS))
def test_the_user_level_clipped_sum_is_that_of_the_users_contributions(name: str) -> None:
    """FusedUserStep: each user's mean gradient clipped as a whole, summed: user_contributions' sum, with the
    users in one pass, in passes of fewer users than the batch holds (three passes), and compiled."""
    from dpsweep.data.users import user_contributions

    torch.manual_seed(0)
    model, pool = MODELS[name]()
    x, y, segment = _user_batch(9, 4, pool)
    expected = torch.cat(
        [c.sum(0).flatten() for c in user_contributions(model, nn.CrossEntropyLoss(), x, y, segment, 9, C).values()]
    )
    for pad_to, mode in ((16, None), (4, None), (4, "default")):
        if mode is not None and name != "mlp":
            continue  # compiling on the CPU takes long: the mlp stands for the compiled pass
        step = fused.FusedUserStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=pad_to, max_examples=4,
                                   mode=mode)  # fmt: skip
        got = step.clipped_sum(x, y, segment)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
        assert step.passes == -(-9 // pad_to) and step.way == "users"
    assert float(expected.norm()) > C  # several users, each clipped to C: a sum that padding could not fake


def test_a_user_level_step_without_users_or_over_its_examples_is_an_error() -> None:
    model, pool = _mlp()
    step = fused.FusedUserStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=4, max_examples=2, mode=None)
    x, y, segment = _user_batch(3, 4, pool, seed=1)
    assert int(torch.bincount(segment).max()) > 2
    with pytest.raises(IndexError):
        step.clipped_sum(x, y, segment)  # a user with more rows than dp.max_examples_per_user
    with pytest.raises(ValueError, match="segment"):
        step.clipped_sum(x, y)
    empty = step.clipped_sum(pool[:0], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert torch.count_nonzero(empty) == 0  # no user sampled: only the noise will be added


@pytest.mark.parametrize("name", list(MODELS))
def test_extra_units_go_through_the_steps_own_clipping_before_its_noise(name: str) -> None:
    """A white-box canary's row (dpsweep.mechanisms.private_step) joins the batch's: clipped by the step's own
    clipping to C, summed with the rows' clipped sum, then noised by the same draw as a plain step's."""
    torch.manual_seed(5)
    model, x = MODELS[name]()
    y = torch.randint(0, 10, (len(x),))
    step = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=32, mode=None)
    extra = {k: torch.zeros(1, *p.shape) for k, p in step.params.items()}
    name0 = step.names[0]
    extra[name0].view(1, -1)[0, 0] = 100.0 * C  # a Dirac row of norm 100·C
    plain = step.clipped_sum(x, y).clone()
    clipped, noisy = step.release(x, y, noise_multiplier=1.0, divisor=2.0, generator=torch.Generator().manual_seed(3),
                                  extra=extra)  # fmt: skip
    flat = torch.cat([clipped[k].flatten() for k in step.names]) * 2.0
    spike = torch.zeros_like(plain)
    spike[0] = 100.0 * C * float(clip_factors(torch.tensor(100.0 * C), C))  # clipped to C
    torch.testing.assert_close(flat, plain + spike, rtol=1e-4, atol=1e-5)
    alone = step.gradient(x, y, noise_multiplier=1.0, divisor=2.0, generator=torch.Generator().manual_seed(3))
    for k in step.names:  # the same noise: the noisy release is the clipped one plus the plain step's noise
        torch.testing.assert_close(noisy[k] - clipped[k], alone[k] - plain_part(step, plain)[k], rtol=1e-4, atol=1e-5)


def plain_part(step: fused.FusedStep, summed: Tensor) -> dict[str, Tensor]:
    """The plain clipped sum over the divisor 2, by parameter name."""
    return step.unflatten(summed / 2.0)


def _dirac(step: fused.FusedStep, name: str, k: int = 1, size: float = 100.0 * C) -> tuple[dict[str, Tensor], int]:
    """``k`` extra units (a white-box canary's rows), each ``size`` at the first coordinate of parameter ``name``,
    and that coordinate's place in the flat vector."""
    extra = {n: torch.zeros(k, *p.shape) for n, p in step.params.items()}
    extra[name].view(k, -1)[:, 0] = size
    return extra, sum(step.params[n].numel() for n in step.names[: step.names.index(name)])


def _with_extra(step: fused.FusedStep, x: Tensor, y: Tensor, extra: dict[str, Tensor], segment: Tensor | None = None
                ) -> Tensor:  # fmt: skip
    """The flat clipped sum the step releases with ``extra`` units (divisor 1)."""
    generator = torch.Generator(x.device).manual_seed(0)
    clipped, _ = step.release(x, y, noise_multiplier=1.0, divisor=1.0, generator=generator, segment=segment,
                              extra=extra)  # fmt: skip
    return torch.cat([clipped[k].flatten() for k in step.names])


def _forgets_biases(self: fused._LinearRows, terms: list[tuple[Tensor, Tensor]], weight: Tensor) -> Tensor:
    """A planted bug in the book-keeping pass's norms: the bias terms left out."""
    squared = torch.zeros_like(weight)
    for (weight_term, _), (trained, _) in zip(terms, self.trained, strict=True):
        if trained:
            squared = squared + weight_term
    return squared


@pytest.mark.parametrize("plant", ["norm_function", "bias_flags"])
def test_a_bug_in_the_book_keeping_passs_norms_is_a_bug_of_the_extra_units_too(
    plant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mlp's pass takes each row's norm from ‖aᵢ‖ and ‖gᵢ‖ (_LinearRows._tail). Its norms made to forget
    the biases (its function that sums the layers' terms replaced, or its record of which biases are trained
    emptied): a canary on a bias, of norm 100·C, gets a norm of 0 from the same pass, so it is not clipped
    (and an audit sees 100·C where C was claimed). (When the canaries were clipped apart from the pass, they
    kept their true norm and were clipped to C: the bug was not seen.)"""
    torch.manual_seed(6)
    model, x = _mlp()
    y = torch.randint(0, 10, (len(x),))
    step = fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=32, mode=None)
    assert step.linear is not None
    extra, at = _dirac(step, "fc2.bias")
    correct, got = step.clipped_sum(x, y).clone(), _with_extra(step, x, y, extra)
    assert float(got[at] - correct[at]) == pytest.approx(C, rel=1e-4)  # a correct pass clips the canary to C
    if plant == "norm_function":
        monkeypatch.setattr(fused._LinearRows, "_squared_norms", _forgets_biases, raising=False)
    else:
        monkeypatch.setattr(step.linear, "trained", [(w, False) for w, _ in step.linear.trained])
    buggy = step.clipped_sum(x, y).clone()
    assert not torch.allclose(buggy, correct)  # the bug is the pass's: its own rows are clipped less
    got = _with_extra(step, x, y, extra)
    assert float(got[at] - buggy[at]) == pytest.approx(100.0 * C, rel=1e-4)  # the canary's norm is the pass's: 0
    torch.testing.assert_close(torch.cat([got[:at], got[at + 1 :]]), torch.cat([buggy[:at], buggy[at + 1 :]]))


def _step_and_batch(
    name: str, users: bool, pad_to: int, users_pad_to: int
) -> tuple[fused.FusedStep, Tensor, Tensor, Tensor | None, Tensor]:
    """A fused step of model ``name`` (at the user level where ``users``: 9 users of up to 4 examples, in
    passes of ``users_pad_to`` users; else the model's pool, in passes of ``pad_to`` rows), its batch (x, y and
    the users' segment ids, or None) and the pool."""
    model, pool = MODELS[name]()
    if users:
        x, y, segment = _user_batch(9, 4, pool)
        step: fused.FusedStep = fused.FusedUserStep(model, nn.CrossEntropyLoss(), max_grad_norm=C,
                                                    pad_to=users_pad_to, max_examples=4, mode=None)  # fmt: skip
        return step, x, y, segment, pool
    y = torch.randint(0, 10, (len(pool),))
    return fused.FusedStep(model, nn.CrossEntropyLoss(), max_grad_norm=C, pad_to=pad_to, mode=None), pool, y, None, pool


@pytest.mark.parametrize(("name", "users"), [("cnn", False), ("mlp", False), ("mlp", True)])
def test_a_bug_in_the_pass_that_clips_the_rows_is_a_bug_of_the_extra_units_too(name: str, users: bool) -> None:
    """The pass itself (the vmap way's and the user level's compiled function, the book-keeping way's tail) made
    to clip at 2C: the canaries, rows of that pass, are clipped at 2C too, in passes of 7 padded rows (three
    parts of canaries over the batch's passes) and in an empty batch (a pass of padding carries them)."""
    torch.manual_seed(7)
    step, x, y, segment, pool = _step_and_batch(name, users, pad_to=7, users_pad_to=7)
    step.padded = True  # as a compiled pass: every pass of 7 rows (or users)
    if step.linear is not None:
        tail = step.linear.tail
        step.linear.tail = lambda inputs, grads, weight, c, *extra: tail(inputs, grads, weight, 2 * c, *extra)
    else:
        own = step._pass

        def doubled(*args: Tensor) -> Tensor:
            step.max_grad_norm = 2 * C
            try:
                return own(*args)
            finally:
                step.max_grad_norm = C

        step._pass = doubled
    extra, at = _dirac(step, step.names[0], k=17)  # 17 canaries: parts of 7, 7 and 3
    spike = torch.zeros(sum(p.numel() for p in step.params.values()))
    spike[at] = 17 * 100.0 * C * float(clip_factors(torch.tensor(100.0 * C), 2 * C))  # each clipped to 2C
    buggy = step.clipped_sum(x, y, segment).clone()
    torch.testing.assert_close(_with_extra(step, x, y, extra, segment), buggy + spike, rtol=1e-4, atol=1e-5)
    empty = (pool[:0], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long) if users else None)
    torch.testing.assert_close(_with_extra(step, *empty[:2], extra, empty[2]), spike, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("name", "users"), [("cnn", False), ("mlp", False), ("mlp", True)])
def test_a_release_without_extra_units_is_a_plain_steps_bit_for_bit(name: str, users: bool) -> None:
    """What a run no audit wraps releases: the step's clipped sum plus N(0, σ²C²), over the divisor, from the
    generator's first draws, exactly; extra units with no rows change nothing."""
    torch.manual_seed(8)
    step, x, y, segment, _ = _step_and_batch(name, users, pad_to=16, users_pad_to=4)
    summed = step.clipped_sum(x, y, segment).clone()
    drawn = torch.normal(0.0, 1.3 * C / 3.0, summed.shape, generator=torch.Generator().manual_seed(1))
    none = {k: torch.zeros(0, *p.shape) for k, p in step.params.items()}
    for extra in (None, none):
        clipped, noisy = step.release(x, y, noise_multiplier=1.3, divisor=3.0, segment=segment, extra=extra,
                                      generator=torch.Generator().manual_seed(1))  # fmt: skip
        assert torch.equal(torch.cat([clipped[k].flatten() for k in step.names]), summed / 3.0)
        assert torch.equal(torch.cat([noisy[k].flatten() for k in step.names]), drawn.add_(summed, alpha=1 / 3.0))
        drawn = torch.normal(0.0, 1.3 * C / 3.0, summed.shape, generator=torch.Generator().manual_seed(1))
