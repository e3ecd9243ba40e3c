"""``dpsweep.memory.probes.probe_table``: probe runs in a real sqlite store read back as the probe table, in
bytes, with the runs that are not complete probes left out and told."""

from __future__ import annotations

from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from dpsweep.memory.probes import MEASURED, probe_table
from dpsweep.memory.tables import logged_values


def _probe_run(client: MlflowClient, experiment: str, config_hash: str, batch_size: int, tags: dict[str, str]) -> str:
    """A FINISHED run logged as a probe logs itself: its tags, params and memory metrics (in MiB)."""
    figures = {name: (i + 1) * 2**20 * batch_size for i, name in enumerate(MEASURED)}  # bytes
    run_id = client.create_run(experiment).info.run_id
    params = {"model.name": "cnn", "dataset.name": "digits", "model.hidden_units": "16",
              "train.batch_size": str(batch_size), "dp.enabled": "True"}  # fmt: skip
    client.log_batch(
        run_id, [Metric(k, v, 0, 0) for k, v in logged_values(figures).items()],
        [Param(k, v) for k, v in params.items()], [RunTag(k, v) for k, v in tags.items()],
    )  # fmt: skip
    client.set_tag(run_id, "config.hash", config_hash)
    client.set_terminated(run_id, "FINISHED")
    return run_id


def test_probe_runs_read_back_in_bytes_and_incomplete_ones_are_told(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("probes", artifact_location=(tmp_path / "mlruns").as_uri())
    tags = {"probe": "true", "dataset.input_shape": "1x16x16", "model.trainable_params": "9962",
            "memory.backend": "cpu-tensors", "device.name": "cpu"}  # fmt: skip
    first = _probe_run(client, experiment, "aaa", 8, tags)
    _probe_run(client, experiment, "bbb", 32, tags)
    broken = _probe_run(client, experiment, "ccc", 8, {k: v for k, v in tags.items() if k != "memory.backend"})
    notes: list[str] = []
    table = probe_table(uri, "probes", note=notes.append)
    assert sorted(table["batch_size"]) == [8, 32] and set(table["grad_sample_mode"]) == {"hooks"}
    small = table.set_index("config_hash").loc["aaa"]
    assert small["run_id"] == first and (small["channels"], small["height"], small["width"]) == (1, 16, 16)
    assert [small[name] for name in MEASURED] == [(i + 1) * 2**20 * 8 for i in range(len(MEASURED))]
    assert notes == [f"run {broken} is not a complete probe ('memory.backend'); left out"]
    only = probe_table(uri, "probes", hashes=["bbb"])
    assert list(only["config_hash"]) == ["bbb"]
