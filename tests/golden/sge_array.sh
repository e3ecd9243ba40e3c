#!/bin/bash

# Parameters
#$ -N dpsweep
#$ -S /bin/bash
#$ -cwd
#$ -t 1-4
#$ -tc 2
#$ -o /sweeps/s1/.submitit/$JOB_ID_$TASK_ID/$JOB_ID_$TASK_ID_0_log.out
#$ -e /sweeps/s1/.submitit/$JOB_ID_$TASK_ID/$JOB_ID_$TASK_ID_0_log.err
#$ -V
#$ -r y
#$ -q gpu.q
#$ -l h_rt=02:00:00
#$ -l s_rt=01:58:30
#$ -pe smp 4
#$ -l mem_free=4096M
#$ -l h_gpu=1

# setup
module load cuda/12
source /opt/venv/bin/activate

# command
export SUBMITIT_EXECUTOR=sge
export SUBMITIT_PREEMPT_SIGNAL=USR1
/opt/venv/bin/python -u -m submitit.core._submit /sweeps/s1/.submitit/%j
