"""The store's answers about a sweep's jobs, for its driver (``launchers/``): their runs by config hash
and status, the table of their results on the parent run, the runs a dead job left RUNNING, an Optuna
trial's run, and private tuning's release of the best trial (and the withholding of everything else).

    from dpsweep.tracking.sweeps import runs_by_hash  # or dpsweep.tracking.runs_by_hash, which imports
    runs_by_hash(uri, "demo")                          # this module (and MLflow) at its first use
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from dpsweep.privacy import certainty
from dpsweep.tracking import OWNER_TAG, PRIVACY_LEDGER, PROCESS_TAG
from dpsweep.tracking.store import differing_params, models_of, retry_busy, set_tags


def sweep_jobs(client: MlflowClient, experiment: str, sweep_id: str) -> list[Any]:
    """The runs of a sweep's jobs (tagged with ``sweep.id``; not its parent run)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`sweep.id` = '{sweep_id}'", max_results=50000)
    return [r for r in runs if r.data.tags.get("sweep.role") != "parent"]


def runs_of_sweep(uri: str, experiment: str, sweep_id: str) -> dict[str, str]:
    """{run id: status} of the runs of a sweep's jobs."""
    return {r.info.run_id: r.info.status for r in sweep_jobs(MlflowClient(uri), experiment, sweep_id)}


RESULTS_TABLE = "results.json"  # the sweep parent run's table of its jobs (MLflow's log_table)


def log_results_table(uri: str, experiment: str, sweep_id: str, parent_run_id: str) -> int:
    """The sweep's jobs as one table on its parent run (``results.json``, MLflow's ``log_table``,
    shown in the run's artifacts): the run name, ``test_accuracy`` and ``epsilon`` first, the
    status, then the params that differ between the jobs. Returns the number of rows."""
    client = MlflowClient(uri)
    runs = sweep_jobs(client, experiment, sweep_id)
    differing = differing_params(runs)
    table: dict[str, list[Any]] = {"run": [r.info.run_name for r in runs]}
    table["test_accuracy"] = [r.data.metrics.get("test_accuracy") for r in runs]
    table["epsilon"] = [r.data.metrics.get("epsilon") for r in runs]
    table["status"] = [r.info.status for r in runs]
    table |= {k: [r.data.params.get(k) for r in runs] for k in differing}
    if runs:
        retry_busy(lambda: client.log_table(parent_run_id, data=table, artifact_file=RESULTS_TABLE))
    return len(runs)


def runs_by_hash(uri: str, experiment: str, status: str = "FINISHED") -> dict[str, str]:
    """{config hash: run id} of the experiment's runs in ``status`` (the newest run per hash). RUNNING
    runs count only when they name their process (tag run.process): older versions' runs left RUNNING
    cannot be told from live ones and must not block their config."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    out: dict[str, str] = {}
    token = None
    while True:
        page = client.search_runs(
            [exp.experiment_id], filter_string=f"attributes.status = '{status}'", max_results=10000,
            order_by=["attributes.start_time ASC"], page_token=token,
        )  # fmt: skip
        for run in page:
            tags = run.data.tags
            if status == "RUNNING" and PROCESS_TAG not in tags:
                continue
            if "config.hash" in tags and tags.get("sweep.role") != "parent":
                out[tags["config.hash"]] = run.info.run_id
        token = page.token
        if not token:
            return out


def trial_run(uri: str, experiment: str, sweep_id: str, trial: int) -> Any:
    """The MLflow run of an Optuna trial of a sweep (None if the job never started one).
    (An MLflow entity: the Optuna search reads it in its own process, see launchers/optuna_sweeper.py.)"""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    found = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`sweep.id` = '{sweep_id}' and tags.`optuna.trial` = '{trial}'"
    )
    return found[0] if found else None


def close_orphaned_runs(uri: str, experiment: str, sweep_id: str) -> list[str]:
    """Mark KILLED the runs of a finished sweep still RUNNING: their job died without closing them."""
    client = MlflowClient(uri)
    orphans = [run_id for run_id, status in runs_of_sweep(uri, experiment, sweep_id).items() if status == "RUNNING"]
    for run_id in orphans:
        set_tags(uri, run_id, {
            "error": "the job ended without closing its run (killed by the scheduler or the OS)",
            "failure.kind": "killed",
        })  # fmt: skip
        retry_busy(lambda run_id=run_id: client.set_terminated(run_id, "KILLED"))  # type: ignore[misc]
    return sorted(orphans)


RELEASED_TAG = "tuning.released"  # a private tuning's FINISHED trials: true for the released one only
# on every run of a private tuning but the released trial (its other trials, whatever their status, and
# its parent run, which holds K): what dpsweep-ui's view leaves out (dpsweep.tracking.views)
WITHHELD_TAG = "tuning.withheld"
ACCOUNTANT_TAG = "tuning.accountant"  # the accountant of epsilon_tuning: rdp (dpsweep.privacy.tuning.ACCOUNTANT)
# the analysis that priced epsilon_tuning (sweep.tuning_analysis: dpsweep.privacy.tuning.ANALYSES); a procedure
# that names none is papernot_steinke's, the only analysis before the key
ANALYSIS_TAG = "tuning.analysis"
BEFORE_ANALYSES = "papernot_steinke"
# a single run's certainty figures (dpsweep.privacy.certainty.FIGURES): the released trial's describe the
# trial alone, not the procedure, and become NaN, as epsilon_pld does
SINGLE_RUN_FIGURES = certainty.FIGURES
# a trial whose batches failed the sampling check (dpsweep.run.attached.SamplingCheck) did not run the
# mechanism its ledger describes: a procedure that selected among its results has no sound ε either
SAMPLING_REFUSED_TAG = "sampling.refused"
INTERVAL_TAG = "epsilon_interval.accountant"  # a single run's, with its certainty figures
VOID_TAG = "tuning.void"  # on the parent and the released trial: why the procedure's ε does not hold
PARENT_LINKS = ("mlflow.parentRunId", "sweep.parent_run_id")  # a job's tags that name its sweep's parent run
# the released trial's other tags that lead to its sweep (and so to the parent run and the other trials) or
# to its seed: the sweep's id (dpsweep.tracking.OWNER_TAG, claim.owner, holds it too) and the config hash,
# a hash of its config with the seed (dpsweep.plan.config_hash), which a search of 2**31 seeds would invert
SWEEP_LINKS = ("sweep.id", OWNER_TAG, "config.hash")


def release_best(
    uri: str, experiment: str, sweep_id: str, objective: str, procedure: Mapping[str, Any]
) -> tuple[str | None, int]:
    """Private tuning's release (issue 33, item 1; issue 54, item 3): tag the sweep's FINISHED trials
    ``tuning.released`` (true for the one best by ``objective`` only) and log ``procedure['epsilon']``,
    the whole procedure's ε, as each one's ``epsilon_tuning``, with its accountant
    (``procedure['accountant']``, rdp) as the tag ``tuning.accountant``. Every other run of the sweep
    (the trials not released, finished or not) is tagged ``tuning.withheld``.

    The released trial reports the procedure: its ``epsilon`` and ``epsilon_rdp`` become the
    procedure's (logged again at the last step, so that they are the latest values), its own RDP ε (its
    ``epsilon_rdp``: the procedure's accountant, at the trial's orders, like for like, whatever its
    ``dp.accountant``) is kept as ``epsilon_single_run``, ``epsilon_pld`` and ``epsilon_prv`` become NaN
    (not computed for the procedure), so do the single run's certainty figures it has
    (:data:`SINGLE_RUN_FIGURES`: its interval's lower end, μ-GDP and attack risk), and its
    ``privacy_ledger.json`` gains the tuning event. It stands
    alone (:func:`_stand_alone`): no tag leads from it to its sweep, the parent run (which holds K, tag
    ``tuning.k``; the parent keeps ``tuning.best_run_id``) or the other trials, and no name or tag to its
    secret ``train.seed``. The models the other trials logged (MLflow 3 LoggedModels, which the
    experiment's Models tab lists whatever dpsweep-ui's view filters: K of them) are deleted, so that
    the released trial's is the sweep's only one. K's secrecy is what Papernot & Steinke 2022's bound
    needs ("Hyperparameter Tuning with Renyi Differential Privacy", ICLR). The finished trials and the
    sweep's parent run are tagged ``tuning.analysis`` (``procedure['analysis']``, :data:`ANALYSIS_TAG`).
    Where a trial failed its sampling check (:func:`void_reason`), the parent and the released trial are
    tagged ``dp.release=not-for-release`` and :data:`VOID_TAG` says why.
    Returns the released run id (None: none finished) and how many finished."""
    client = MlflowClient(uri)
    jobs = sweep_jobs(client, experiment, sweep_id)
    runs = [r for r in jobs if r.info.status == "FINISHED"]
    best = max(runs, key=lambda r: r.data.metrics.get(objective, float("-inf")), default=None)
    analysis = str(procedure.get("analysis", BEFORE_ANALYSES))
    void = void_reason(jobs)
    for r in runs:
        _report_procedure(client, r, r is best, procedure, void)
    parents = {r.data.tags[k] for r in jobs for k in PARENT_LINKS if r.data.tags.get(k)}
    parent_tags = {ANALYSIS_TAG: analysis} | ({"dp.release": "not-for-release", VOID_TAG: void} if void else {})
    for parent in sorted(parents):  # before _stand_alone removes the released trial's link to it
        set_tags(uri, parent, parent_tags)
    withheld = [r for r in jobs if r is not best]
    for r in withheld:
        retry_busy(lambda run_id=r.info.run_id: client.set_tag(run_id, WITHHELD_TAG, "true"))  # type: ignore[misc]
    if jobs:
        delete_models(client, jobs[0].info.experiment_id, {r.info.run_id for r in withheld})
    if best is not None:
        _stand_alone(client, best)
    return (best.info.run_id if best is not None else None), len(runs)


def _report_procedure(
    client: MlflowClient, r: Any, released: bool, procedure: Mapping[str, Any], void: str | None
) -> None:
    """A finished trial of a private tuning tagged released or not, with the procedure's ε; the released one
    reports the procedure (see :func:`release_best`)."""
    run_id = r.info.run_id
    proc, accountant = float(procedure["epsilon"]), str(procedure["accountant"])
    now = int(time.time() * 1000)
    step = max((m.step for m in client.get_metric_history(run_id, "epsilon")), default=0)
    metrics = [Metric("epsilon_tuning", proc, now, step)]
    tags = [RunTag(RELEASED_TAG, str(released).lower()), RunTag(ACCOUNTANT_TAG, accountant),
            RunTag(ANALYSIS_TAG, str(procedure.get("analysis", BEFORE_ANALYSES)))]  # fmt: skip
    if released:
        own = r.data.metrics.get("epsilon_rdp", float("nan"))  # the procedure's accountant, rdp
        metrics += [Metric("epsilon_single_run", own, now, step), Metric("epsilon", proc, now, step),
                    Metric("epsilon_rdp", proc, now, step), Metric("epsilon_pld", float("nan"), now, step),
                    Metric("epsilon_prv", float("nan"), now, step)]  # fmt: skip
        metrics += [Metric(k, float("nan"), now, step) for k in SINGLE_RUN_FIGURES if k in r.data.metrics]
        tags.append(RunTag("tuning.epsilon", TUNED_EPSILON_NOTE))
        if void is not None:
            tags += [RunTag("dp.release", "not-for-release"), RunTag(VOID_TAG, void)]
        _add_tuning_event(client, run_id, procedure, own)
    retry_busy(lambda: client.log_batch(run_id, metrics=metrics, tags=tags))
    if released and INTERVAL_TAG in r.data.tags:  # whose interval: none is logged for the procedure
        retry_busy(lambda: client.delete_tag(run_id, INTERVAL_TAG))


def void_reason(jobs: list[Any]) -> str | None:
    """Why a private tuning's ε does not hold, or None: a trial whose sampling check refused its batches
    (tag :data:`SAMPLING_REFUSED_TAG`) ran another mechanism than the ledgers the procedure was priced on,
    and the selection read its result."""
    refused = [r for r in jobs if r.data.tags.get(SAMPLING_REFUSED_TAG)]
    if not refused:
        return None
    return (
        f"{len(refused)} trial(s) failed the sampling check ({refused[0].data.tags[SAMPLING_REFUSED_TAG]}): "
        "the procedure's ε assumes every trial ran its ledger's mechanism"
    )


def void_of(uri: str, run_id: str) -> str | None:
    """Why a private tuning's ε does not hold, as its parent run ``run_id`` is tagged (:data:`VOID_TAG`), or None."""
    tags: dict[str, str] = retry_busy(lambda: MlflowClient(uri).get_run(run_id).data.tags)
    return tags.get(VOID_TAG)


def delete_models(client: MlflowClient, experiment_id: str, run_ids: set[str]) -> list[str]:
    """Delete the LoggedModels that the runs ``run_ids`` (withheld trials of a private tuning) logged in
    the experiment: MLflow's Models tab lists an experiment's models whatever a view of its runs filters,
    and each names its run and carries its params. MLflow marks them deleted (searches leave them out;
    ``mlflow gc`` removes their files). Returns the ids of the models deleted."""
    gone = [m.model_id for m in models_of(client, experiment_id) if m.source_run_id in run_ids]
    for model_id in gone:
        retry_busy(lambda model_id=model_id: client.delete_logged_model(model_id))  # type: ignore[misc]
    return gone


def seedless_name(name: str, seed: str | None) -> str:
    """A run's name without its ``train.seed``: ``σ1-C1-B64-s1337566753-e1-digits-cnn`` (dpsweep.run.records'
    names) becomes ``σ1-C1-B64-e1-digits-cnn``; a seed left anywhere else in a name reads ``seed-withheld``."""
    if not seed:
        return name
    name = re.sub(rf"-s{re.escape(seed)}(?=-|$)", "", name)
    return name.replace(seed, "seed-withheld")


def _stand_alone(client: MlflowClient, run: Any) -> None:
    """The released trial without what leads from it to K or its seed: the tags naming its sweep's
    parent run (which holds ``tuning.k``; :data:`PARENT_LINKS`) or its sweep, whose search lists the
    parent and every trial, and its config hash, a hash of its seed (:data:`SWEEP_LINKS`) removed; and in
    dpsweep-ui's view (not ``tuning.withheld``). Nothing needs them once the sweep is over: its driver
    finds the jobs by ``sweep.id`` until the release, ``dpsweep-report --sweep`` finds the released trial
    by the parent's ``tuning.best_run_id``, and no later sweep's config has this trial's secret seed (the
    hash skips FINISHED configs). Its name holds no seed (``dpsweep.run.records``); a run of an older
    dpsweep's loses it here (:func:`seedless_name`), but not its ``train.seed`` param, which MLflow cannot
    delete: the store itself is not for release."""
    run_id = run.info.run_id
    for key in (*PARENT_LINKS, *SWEEP_LINKS, WITHHELD_TAG):  # withheld: by dpsweep-ui during the sweep
        if key in run.data.tags:
            retry_busy(lambda key=key: client.delete_tag(run_id, key))  # type: ignore[misc]
    name = run.info.run_name or ""
    seedless = seedless_name(name, run.data.params.get("train.seed"))
    if seedless != name:
        retry_busy(lambda: client.update_run(run_id, name=seedless))


PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"  # mlflow.environment_variables: tqdm bars of downloads


@contextlib.contextmanager
def no_download_bar() -> Iterator[None]:
    """MLflow's artifact downloads without their tqdm bar ("Downloading artifacts: 100%|…", on stderr, drawn
    whatever the size for a download of files: ``mlflow.utils.file_utils.ArtifactProgressBar.files``) for
    the block: dpsweep's own downloads are a few small files, and the bar broke into the sweep's lines
    (issue 56, item 7). MLflow reads the variable at each download; the user's setting is back afterwards."""
    before = os.environ.get(PROGRESS_BAR_ENV)
    os.environ[PROGRESS_BAR_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_BAR_ENV, None)
        else:
            os.environ[PROGRESS_BAR_ENV] = before


TUNED_EPSILON_NOTE = (
    "epsilon and epsilon_rdp are the whole private tuning procedure's (RDP, Papernot & Steinke 2022), the "
    "figure to publish with this model; epsilon_single_run is this trial's alone, under RDP too (its "
    "epsilon_rdp before the release); epsilon_pld and epsilon_prv are not computed for the procedure"
)


# what each analysis repeats (dpsweep.privacy.tuning.ANALYSES), for the tuning event of the released ledger
TUNED_LEDGER = {
    "papernot_steinke": "the dominant candidate's ledger",
    "mixture": "one trial's ledger, its candidate drawn uniformly from the grid",
}


def _add_tuning_event(client: MlflowClient, run_id: str, procedure: Mapping[str, Any], own: float) -> None:
    """The released trial's ``privacy_ledger.json`` with the tuning as its last event, and the
    procedure's ε as the ledger's, under the procedure's accountant (``procedure['accountant']``, rdp);
    the trial's own ε, ``own``, under the same accountant, kept as ``epsilon_single_run`` (like for like:
    ``{"rdp": ε}``, beside the ledger's ``{"rdp": ε}``). Its ``certainty`` (one run's interval, μ and
    attack risk, which would understate the procedure's) is dropped."""
    accountant = str(procedure["accountant"])
    with tempfile.TemporaryDirectory(prefix="dpsweep-ledger-") as tmp, no_download_bar():
        path = client.download_artifacts(run_id, PRIVACY_LEDGER, tmp)
        record = json.loads(Path(path).read_text())
    record["epsilon_single_run"] = {accountant: own}
    record["epsilon"] = {accountant: float(procedure["epsilon"])}
    # the trial's interval, μ and attack risk are one run's, not the procedure's (its metrics are NaN)
    record.pop("certainty", None)
    record["accountant"] = accountant
    record["events"] = [*record.get("events", []), {
        "name": "tuning",
        "event": f"RepeatAndSelect({TUNED_LEDGER.get(str(procedure.get('analysis')), TUNED_LEDGER[BEFORE_ANALYSES])}, "
                 f"K ~ {procedure['distribution']} with mean {procedure['mean_trials']:g})",
        "params": {k: v for k, v in procedure.items() if k != "epsilon"},
        "note": f"K trials drawn from the candidates, {procedure['selection']} released; this trial's own "
                f"ε under {accountant} was {own:.6g}, the procedure's under {accountant} is "
                f"{float(procedure['epsilon']):.6g}. {procedure['reference']}",
        "epsilon_alone": None, "share_of_rdp": None,
    }]  # fmt: skip
    client.log_text(run_id, json.dumps(record, indent=2), PRIVACY_LEDGER)
