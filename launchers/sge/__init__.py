"""Son of Grid Engine (SGE) backend for submitit: ``qsub`` job arrays, ``qstat``/``qacct`` states, ``qdel``.

Registered through submitit's plugin entry points (group ``submitit``), so it is available as::

    import submitit
    ex = submitit.AutoExecutor(folder="logs/%j", cluster="sge")
    ex.update_parameters(timeout_min=30, mem_gb=4, sge_queue="all.q", sge_array_parallelism=2)
    jobs = ex.map_array(pow, [1, 2, 3], [2, 2, 2])   # one array job: qsub -t 1-3 -tc 2
    print([j.result() for j in jobs])

Every submission is an array job (``-t 1-N``, a single job is ``-t 1-1``), submitted on hold
(``-h``) and released (``qrls``) once each task's folder and pickle exist, so no task can start
before its inputs are in place. Task ids are SGE's, 1-based: submitit job ids are ``<JOB_ID>_<TASK_ID>``.
"""

from dpsweep.launchers.sge.executor import (
    QsubOptions,
    SgeExecutor,
    SgeInfoWatcher,
    SgeJob,
    SgeJobEnvironment,
    make_qsub_script,
)

__all__ = ["QsubOptions", "SgeExecutor", "SgeInfoWatcher", "SgeJob", "SgeJobEnvironment", "make_qsub_script"]
