"""Several trials on one device: each trial's share of the GPU memory, and the K that fits.

K trials that share one GPU (``launcher.trials_per_device``) are K processes. Each holds its own
CUDA context, which lives outside PyTorch's caching allocator (so no probe counts it), and its own
allocator, whose peaks the memory model predicts. ``launcher.gpu_memory`` is the memory one process's
allocator may take (the card less one context), so K processes leave each one

    share(K) = (gpu_memory - (K - 1) * CUDA_CONTEXT_BYTES) / K

and the largest K whose trials fit together is the largest with ``peak + resident <= usable(share(K))``
for every trial (``usable``: less the allocator's headroom, :func:`dpsweep.memory.predict.usable_bytes`),
i.e. ``K <= (gpu_memory + c) / (need / (1 - headroom) + c)`` with ``c`` the context and ``need`` the
largest trial's peak plus resident data. A trial plans its physical batch against its share, so a K set
by hand above that still runs, in smaller passes.

No torch here: the config checks, ``dpsweep-plan`` and the sweeper use it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# The device memory a CUDA process holds outside the caching allocator (its context, cuBLAS and cuDNN
# workspaces): what torch.cuda.mem_get_info() lost, less memory_reserved(), after one cnn step in a
# fresh process. Measured on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130), 2026-11-26:
# benchmarks/packing.py (section context), analysis/data/packing_h100.json: 763 MiB.
CUDA_CONTEXT_BYTES = 763 * 2**20


def trial_share_bytes(gpu_memory_bytes: int, trials: int, context_bytes: int = CUDA_CONTEXT_BYTES) -> int:
    """The GPU memory one of ``trials`` processes sharing the device may plan against (see the module doc)."""
    if trials < 1:
        raise ValueError(f"trials must be 1 or more, got {trials}")
    return (gpu_memory_bytes - (trials - 1) * context_bytes) // trials


def trials_that_fit(
    need_bytes: Iterable[float],
    gpu_memory_bytes: int,
    headroom: float,
    cap: int,
    context_bytes: int = CUDA_CONTEXT_BYTES,
) -> int:
    """The largest K <= ``cap`` for which each trial's ``need_bytes`` (its predicted peak plus its
    resident data) fits its share of ``gpu_memory_bytes`` less ``headroom``; 1 when even one trial
    alone does not fit (its own plan then says so)."""
    need = max(need_bytes)

    def fits(k: int) -> bool:
        return trial_share_bytes(gpu_memory_bytes, k, context_bytes) * (1 - headroom) >= need

    k = max(1, math.floor((gpu_memory_bytes + context_bytes) / (need / (1 - headroom) + context_bytes)))
    while k > 1 and not fits(k):  # the closed form, corrected for the whole bytes of each share
        k -= 1
    while fits(k + 1):
        k += 1
    return max(1, min(cap, k))
