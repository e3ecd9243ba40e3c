"""The Grid Engine submitit backend, without a scheduler: job script (golden file), parsers, registry."""

from __future__ import annotations

import os

import pytest
import submitit
from helpers import REPO
from submitit.core.plugins import get_executors

from dpsweep.launchers.sge import QsubOptions, SgeExecutor, SgeJobEnvironment, make_qsub_script
from dpsweep.launchers.sge.executor import parse_qacct, parse_qstat_xml

GOLDEN = REPO / "tests" / "golden"


def _script() -> str:
    options = QsubOptions(
        job_name="dpsweep",
        queue="gpu.q",
        timeout_min=120,
        cpus_per_task=4,
        gpus_per_node=1,
        gpu_resource="h_gpu={gpus}",
        mem_gb=16,
        array_parallelism=2,
        setup=["module load cuda/12", "source /opt/venv/bin/activate"],
    )
    command = "/opt/venv/bin/python -u -m submitit.core._submit /sweeps/s1/.submitit/%j"
    return make_qsub_script(command, "/sweeps/s1/.submitit/%j", options, array_size=4)


def test_job_script_matches_the_golden_file() -> None:
    golden = GOLDEN / "sge_array.sh"
    if os.environ.get("DPSWEEP_UPDATE_GOLDEN") == "1":  # regenerate on purpose, then review the diff
        golden.write_text(_script())
    assert _script() == golden.read_text()


def test_script_directives() -> None:
    lines = _script().splitlines()
    assert "#$ -t 1-4" in lines and "#$ -tc 2" in lines  # array and its parallelism
    assert "#$ -l h_rt=02:00:00" in lines and "#$ -l s_rt=01:58:30" in lines  # SIGUSR1 90 s before the end
    assert "#$ -l mem_free=4096M" in lines  # 16 GiB over 4 slots
    assert "#$ -l h_gpu=1" in lines and "#$ -pe smp 4" in lines and "#$ -q gpu.q" in lines
    assert "#$ -o /sweeps/s1/.submitit/$JOB_ID_$TASK_ID/$JOB_ID_$TASK_ID_0_log.out" in lines
    assert "#$ -e /sweeps/s1/.submitit/$JOB_ID_$TASK_ID/$JOB_ID_$TASK_ID_0_log.err" in lines
    assert lines.index("module load cuda/12") < lines.index("export SUBMITIT_EXECUTOR=sge")


def test_single_cpu_no_gpu_no_memory_requests_nothing_extra() -> None:
    text = make_qsub_script("true", "/f/%j", QsubOptions(timeout_min=1))
    assert "-pe" not in text and "gpu" not in text and "mem_free" not in text and "s_rt" not in text
    assert "#$ -t 1-1" in text


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"gpu_resource": "gpu=1"}, "placeholder"), ({"array_parallelism": 0}, ">= 1")]
)
def test_bad_script_parameters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QsubOptions(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 1"):
        make_qsub_script("true", "/f", array_size=0)


def test_qsub_terse_output() -> None:
    assert SgeExecutor._get_job_id_from_submission_command("123.1-4:1\n") == "123"
    assert SgeExecutor._get_job_id_from_submission_command(b"77\n") == "77"
    with pytest.raises(submitit.core.utils.FailedSubmissionError):
        SgeExecutor._get_job_id_from_submission_command("Unable to run job: denied")


QSTAT = """<?xml version='1.0'?>
<job_info  xmlns:xsd="http://arc.liv.ac.uk/repos/darcs/sge/source/dist/util/resources/schemas/qstat/qstat.xsd">
  <queue_info>
    <job_list state="running">
      <JB_job_number>12</JB_job_number><JB_name>dpsweep</JB_name><state>r</state><tasks>1</tasks>
    </job_list>
    <job_list state="running">
      <JB_job_number>12</JB_job_number><JB_name>dpsweep</JB_name><state>r</state><tasks>2</tasks>
    </job_list>
  </queue_info>
  <job_info>
    <job_list state="pending">
      <JB_job_number>12</JB_job_number><JB_name>dpsweep</JB_name><state>qw</state><tasks>3-5:1</tasks>
    </job_list>
    <job_list state="pending">
      <JB_job_number>13</JB_job_number><JB_name>x</JB_name><state>Eqw</state><tasks>1,3</tasks>
    </job_list>
  </job_info>
</job_info>
"""


def test_qstat_xml_states_per_task() -> None:
    info = parse_qstat_xml(QSTAT)
    assert {k: v["State"] for k, v in info.items()} == {
        "12_1": "RUNNING", "12_2": "RUNNING", "12_3": "PENDING", "12_4": "PENDING", "12_5": "PENDING",
        "13_1": "FAILED", "13_3": "FAILED",
    }  # fmt: skip
    assert parse_qstat_xml("") == {}


QACCT = """==============================================================
qname        all.q
hostname     node1
jobname      dpsweep
jobnumber    12
taskid       1
failed       0
exit_status  0
==============================================================
qname        all.q
jobnumber    12
taskid       2
failed       0
exit_status  3
==============================================================
qname        all.q
jobnumber    12
taskid       3
failed       100 : assumedly after job
exit_status  137                  (Killed)
"""


def test_qacct_states_per_task() -> None:
    info = parse_qacct(QACCT)
    assert {k: v["State"] for k, v in info.items()} == {"12_1": "COMPLETED", "12_2": "FAILED", "12_3": "CANCELLED"}
    assert info["12_2"]["exit_status"] == "3"


def test_registered_through_submitit_entry_points() -> None:
    assert get_executors()["sge"] is SgeExecutor
    assert SgeJobEnvironment.name() == "sge"


def test_job_environment_reads_sge_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "sge")
    monkeypatch.setenv("JOB_ID", "42")
    monkeypatch.setenv("SGE_TASK_ID", "3")
    env = SgeJobEnvironment()
    assert env.activated() and env.job_id == "42_3" and env.num_tasks == 1 and env.global_rank == 0
    monkeypatch.setenv("SGE_TASK_ID", "undefined")  # not an array job
    assert env.job_id == "42"
