"""The sampling check (issue 58, item 3) of what is not one process's private step: a task run that has no
private step but counts its own batches (``SampledUnits``) is checked, an honest one passed and one drawn
at twice its ledger's rate refused; each rank's counts are summed over a real gloo group of 2 processes by
step; and the runner asks the audit for the sampled set's size, never compares its mode's name."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import Composer
from torch.utils.data import TensorDataset

import dpsweep.run.attached
from dpsweep.audit.black_box import InputCanaries
from dpsweep.config import to_config
from dpsweep.data.facts import DatasetFacts
from dpsweep.distributed.ranks import summed_by_step
from dpsweep.mechanisms.private_step import Attachment
from dpsweep.plan import prepare
from dpsweep.privacy import ledger
from dpsweep.privacy.ledger import Ledger
from dpsweep.privacy.streams import Streams
from dpsweep.run.attached import Attached
from dpsweep.tasks import RunInputs

DIGITS = DatasetFacts(1437, (1, 28, 28), 10)


class ToyCountedRun:
    """A toy task run with no private step (not a PrivateRun) that draws Poisson batches of its N units at
    ``rate`` and says what it sampled (``SampledUnits``); its ledger claims ``claimed``."""

    def __init__(self, n: int, rate: float, claimed: float, steps: int, seed: int = 0) -> None:
        generator = np.random.default_rng(seed)
        self.units = [(t, int(generator.binomial(n, rate))) for t in range(steps)]
        self.claimed, self.steps = claimed, steps

    def sampled_units(self) -> Sequence[tuple[int, int]]:
        return self.units

    def privacy_ledger(self) -> Ledger:
        return Ledger((ledger.dpsgd(1.0, self.claimed, self.steps),))


def _inputs(make_cfg: Composer) -> RunInputs:
    cfg = to_config(make_cfg())
    return RunInputs(cfg, prepare(cfg, DIGITS), None, torch.device("cpu"), Streams.of_run(0, "0" * 16))  # type: ignore[arg-type]


@pytest.mark.parametrize(("rate", "verdict"), [(0.03, "passed"), (0.06, "refused")])
def test_a_task_run_that_counts_its_own_batches_is_checked(make_cfg: Composer, rate: float, verdict: str) -> None:
    inputs = _inputs(make_cfg)
    toy = ToyCountedRun(inputs.plan.facts.n_train, rate, claimed=0.03, steps=200)
    attached = Attached.of(inputs, toy, ())  # type: ignore[arg-type]
    assert CHECK_NOTE not in attached.tags(), attached.tags()
    attached.begin_epoch(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))
    metrics = attached.result(toy)  # type: ignore[arg-type]
    assert (metrics["sampling_p_value"] < 1e-6) == (verdict == "refused"), metrics
    assert attached.check is not None and attached.check.end_tags()["sampling.check"] == verdict


CHECK_NOTE = "sampling.check"  # where a run has no check, Attached.tags() says why under this tag


def test_other_attachments_still_need_a_private_run(make_cfg: Composer) -> None:
    toy = ToyCountedRun(1437, 0.03, 0.03, 10)
    with pytest.raises(TypeError, match="not a private run"):
        Attached(toy, [Attachment()])  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SHARES: dict[int, list[tuple[int, int | None]]] = {  # rank 1 did not count step 2
    0: [(0, 3), (1, 0), (2, 5)],
    1: [(0, 4), (1, 2), (2, None)],
}


def _summing_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    summed = summed_by_step(SHARES[rank])
    empty = summed_by_step([] if rank == 0 else [(0, 7)])  # a rank that counted nothing still joins
    torch.save({"summed": summed, "empty": empty}, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow  # 6-9 s on 2 cores: two spawned processes, each importing torch
def test_each_steps_shares_are_summed_over_a_gloo_group_of_two(tmp_path: Path) -> None:
    out = str(tmp_path / "summed")
    mp.spawn(_summing_rank, args=(_free_port(), out), nprocs=2)
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}", weights_only=False)
        assert got["summed"] == [(0, 7), (1, 2), (2, None)], (rank, got)  # alike on every rank
        assert got["empty"] == [(0, 7)], (rank, got)


def test_the_runner_asks_the_audit_not_its_modes_name() -> None:
    source = Path(dpsweep.run.attached.__file__).read_text()
    assert '"black_box"' not in source and "'black_box'" not in source


@pytest.mark.parametrize("added", [False, True], ids=["example_level", "user_level"])
def test_a_black_box_audit_declares_the_set_it_samples(added: bool) -> None:
    """Example level: N - m + the included canaries, the size of the set the run samples; user level
    (``added``): every user, and each included canary a user of its own, U + the included."""
    train = TensorDataset(torch.randn(300, 4), torch.randint(0, 10, (300,)))
    canaries = InputCanaries(train, num_classes=10, count=40, seed=3, added=added)
    included = int(canaries.included.sum())
    assert 0 < included < 40
    if added:
        assert canaries.sampled_population(120) == 120 + included  # 120 users own the 300 examples
        assert len(canaries.training_set()) == 300 + included  # type: ignore[arg-type]
    else:
        assert canaries.sampled_population(300) == len(canaries.training_set()) == 300 - 40 + included  # type: ignore[arg-type]
