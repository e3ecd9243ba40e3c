"""A run's private streams (dpsweep.privacy.streams): one per purpose and rank, none of them the init's,
distinct across the configs of a sweep, shared only when asked, and fresh in secure mode."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dpsweep.privacy.streams import SEED_BITS, Purpose, Streams, described


def test_each_purpose_and_rank_has_its_own_stream_below_torchs_seed_range() -> None:
    streams = Streams.of_run(seed=0, config_hash="0f3c9a1b2c3d4e5f")
    seeds = [streams.seed(p, rank) for p in Purpose for rank in range(4)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    assert 0 not in seeds  # not train.seed itself: the init's stream is torch.manual_seed(train.seed)


def test_a_run_reproduces_its_streams_from_its_seed_and_config() -> None:
    a = Streams.of_run(seed=3, config_hash="00000000000000ff")
    b = Streams.of_run(seed=3, config_hash="00000000000000ff")
    assert [a.seed(p) for p in Purpose] == [b.seed(p) for p in Purpose]


def test_two_configs_that_share_train_seed_draw_independent_noise() -> None:
    """Two trials of a sweep with one train.seed and different σ: their noise streams are unrelated
    (their first normals correlate as independent draws do, not at 0.979 as the audit found)."""
    one = Streams.of_run(seed=0, config_hash="1111111111111111").numpy(Purpose.noise)
    two = Streams.of_run(seed=0, config_hash="2222222222222222").numpy(Purpose.noise)
    a, b = one.standard_normal(100_000), two.standard_normal(100_000)
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02  # 5σ of the correlation of independent draws is 0.016


def test_shared_streams_only_when_asked_and_never_in_secure_mode() -> None:
    a = Streams.of_run(seed=0, config_hash="1111111111111111", shared_seed=7)
    b = Streams.of_run(seed=5, config_hash="2222222222222222", shared_seed=7)
    assert a.seed(Purpose.noise) == b.seed(Purpose.noise)
    assert "dp.stream_seed" in described(False, 7) and "os-entropy" in described(True, None)


def test_secure_streams_are_fresh_every_time() -> None:
    runs = [Streams.of_run(seed=0, config_hash="1111111111111111", secure=True) for _ in range(3)]
    assert all(r.secure for r in runs)
    for a, b in itertools.combinations(runs, 2):
        assert a.seed(Purpose.sampling) != b.seed(Purpose.sampling)
        assert a.seed(Purpose.noise) != b.seed(Purpose.noise)


@pytest.mark.parametrize("seed", [-1, 2**70])
def test_any_integer_seed_gives_streams(seed: int) -> None:
    assert 0 <= Streams.of_run(seed=seed, config_hash="ab").seed(Purpose.sampling) < 2**SEED_BITS


def test_a_cpu_generator_keeps_every_bit_of_a_private_seed() -> None:
    """torch's CPU generator keeps the low 32 bits of manual_seed's argument: a private stream seeded so
    would be found in 2**32 guesses. private_generator keeps the 63 bits of a stream's seed."""
    import torch

    from dpsweep.data.resident import private_generator

    seed = Streams.of_run(seed=0, config_hash="1111111111111111", secure=True).seed(Purpose.noise)
    twin = seed ^ (1 << 40)  # the same low 32 bits
    assert torch.equal(  # why: manual_seed alone cannot tell them apart
        torch.rand(8, generator=torch.Generator().manual_seed(seed)),
        torch.rand(8, generator=torch.Generator().manual_seed(twin)),
    )
    assert not torch.equal(
        torch.rand(8, generator=private_generator("cpu", seed)), torch.rand(8, generator=private_generator("cpu", twin))
    )
    assert torch.equal(  # and it reproduces from its seed
        torch.randn(8, generator=private_generator("cpu", seed)),
        torch.randn(8, generator=private_generator("cpu", seed)),
    )
    drawn = torch.rand(200_000, generator=private_generator("cpu", seed))
    assert abs(float(drawn.mean()) - 0.5) < 0.005 and abs(float(drawn.var()) - 1 / 12) < 0.002  # uniform
