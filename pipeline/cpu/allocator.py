"""glibc malloc's policy for a CPU run's large blocks (set_cpu_allocator): kept for reuse by a
whole replica per process (no page fault per 4 KiB of a step's fresh tensors), given back at once
under FSDP2 (whose per-block buffers would otherwise fragment the heap). bench/results/ has the
faults, step times and peaks of both."""

from __future__ import annotations

import ctypes
import os

import torch

from pipeline.metrics import get_logger

MMAP_THRESHOLD = 128 * 1024  # glibc's default; fixed, it stops malloc raising it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)
# "release" (FSDP2): every freed block of MMAP_THRESHOLD or more goes back to the OS at once.
# "keep" (a whole replica per process): every block comes from the heap (no mmap: glibc's
# threshold stops at 32 MiB, which a step's fp32 loss chunk or head gradient reaches), and the
# heap is never trimmed (-1), so a step's buffers come back without page faults, as a GPU's
# caching allocator hands them back. bench/results/ has the faults, step times and peaks.
ALLOCATOR_MODES = {"release": ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD),),
                   "keep": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))}
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_",
                    "MALLOC_TOP_PAD_")


def set_cpu_allocator(mode: str) -> bool:
    """Set glibc malloc's policy for large blocks (ALLOCATOR_MODES) for the rest of the process.

    By default glibc mmaps every block above its threshold (raised towards 32 MiB as big blocks
    are freed, but a block of the size just freed is mmapped again) and unmaps it on free, and
    trims the heap's free top: a training step's tensors (activations, gradients, the loss's
    buffers) are then faulted in afresh every step, a page fault per 4 KiB; "keep" ends that for
    all but the largest, at the price of the RSS staying at its peak. FSDP2's per-block buffers
    (gathered parameters, unsharded gradients, reduce-scatter inputs) are the opposite case: kept
    in the heap they fragment, and a rank's peak RSS grows far past the sharded state the plan
    counts, so "release" gives them back. bench/results/ has the faults,
    step times and peaks of both. Returns whether it was set: not when the user chose with a
    MALLOC_*_ variable, or malloc is not glibc's."""
    if any(k in os.environ for k in _USER_MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in ALLOCATOR_MODES[mode])


def keep_freed_blocks_after_first_step(optimizer: torch.optim.Optimizer) -> None:
    """set_cpu_allocator("keep") once `optimizer` has stepped: by then the run's long-lived
    tensors (the parameters, the optimizer's state, made at its first step) are placed, and the
    heap the later steps reuse holds only what a step frees. Kept from the start, the first
    step's buffers and that state interleave, and the peak RSS grows by the holes."""
    def keep(*_):
        handle.remove()
        if set_cpu_allocator("keep"):
            get_logger().info("CPU: glibc malloc keeps freed blocks for reuse from now on: a "
                              "step's buffers cost no page faults, and the RSS stays at its peak "
                              "(set MALLOC_MMAP_MAX_ to choose another)")

    handle = optimizer.register_step_post_hook(keep)



def release_freed_blocks() -> None:
    """set_cpu_allocator("release") for FSDP2 on CPU: sharding is for memory, and on CPU memory
    only shrinks with the ranks once malloc gives the freed per-block buffers back (a step costs
    more page faults for it)."""
    if set_cpu_allocator("release"):
        get_logger().info("FSDP2 on CPU: glibc malloc's mmap threshold fixed at %d KiB, so freed "
                          "buffers go back to the OS (set MALLOC_MMAP_THRESHOLD_ to choose "
                          "another)", MMAP_THRESHOLD // 1024)
