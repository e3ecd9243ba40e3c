"""A Slurm job of one run across devices (dpsweep.launchers.hydra_launchers.ranks_resources): a task a rank."""

from __future__ import annotations

from dpsweep.launchers.hydra_launchers import ranks_resources


def test_a_run_across_devices_asks_for_a_task_a_gpu_and_the_memory_of_each_rank() -> None:
    gpus = {"cpus_per_task": 4, "gpus_per_node": 1, "mem_gb": 16, "timeout_min": 60}
    assert ranks_resources(gpus, 4) == {"tasks_per_node": 4, "nodes": 1, "gpus_per_node": 4, "mem_gb": 64}
    cpu = {"cpus_per_task": 1, "gpus_per_node": 0, "mem_gb": 4}
    assert ranks_resources(cpu, 2) == {"tasks_per_node": 2, "nodes": 1, "mem_gb": 8}  # no GPU where none was asked
    two_nodes = ranks_resources(gpus, 4, nodes=2)  # 8 ranks: 4 tasks, 4 GPUs and 4 ranks' memory on each node
    assert two_nodes == {"tasks_per_node": 4, "nodes": 2, "gpus_per_node": 4, "mem_gb": 64}
