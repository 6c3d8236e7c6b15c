"""glibc malloc's policy for a CPU run's large blocks (bench/results/ has the page faults, step
times and peaks of both).

By default glibc mmaps every block above its threshold (raised towards 32 MiB as big blocks are
freed) and unmaps it on free, and trims the heap's free top: a step's fresh tensors (activations,
gradients, the loss's buffers) then cost a page fault per 4 KiB, every step. "keep", for a whole
replica per process, ends that, as a GPU's caching allocator would, at the price of the RSS
staying at its peak. FSDP2's per-block buffers are the opposite case: kept in the heap they
fragment it, and a rank's RSS grows far past the sharded state, so "release" gives them back."""

from __future__ import annotations

import ctypes
import os

import torch

from lmforge.pipeline.metrics import get_logger

MMAP_THRESHOLD = 128 * 1024  # glibc's default; fixed, it stops malloc raising it
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameters (malloc.h)
# "release": every freed block of MMAP_THRESHOLD or more goes back to the OS at once. "keep":
# every block from the heap (no mmap: glibc's threshold stops at 32 MiB, which a step's fp32
# loss chunk or head gradient reaches), and the heap never trimmed (-1).
ALLOCATOR_MODES = {"release": ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD),),
                   "keep": ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))}
_USER_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_",
                    "MALLOC_TOP_PAD_")


def set_cpu_allocator(mode: str) -> bool:
    """Set glibc malloc's policy (ALLOCATOR_MODES) for the rest of the process. Returns whether
    it was set: not when the user chose with a MALLOC_*_ variable, or malloc is not glibc's."""
    if any(k in os.environ for k in _USER_MALLOC_ENV):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in ALLOCATOR_MODES[mode])


def keep_freed_blocks_after_first_step(optimizer: torch.optim.Optimizer) -> None:
    """Policy "keep" once `optimizer` has stepped: the long-lived tensors (parameters, optimizer
    state made at its first step) are placed by then. Kept from the start, the first step's
    buffers and that state interleave, and the peak RSS grows by the holes."""
    def keep(*_):
        handle.remove()
        if set_cpu_allocator("keep"):
            get_logger().info("CPU: glibc malloc keeps freed blocks for reuse from now on: a "
                              "step's buffers cost no page faults, and the RSS stays at its peak "
                              "(set MALLOC_MMAP_MAX_ to choose another)")

    handle = optimizer.register_step_post_hook(keep)


def release_freed_blocks() -> None:
    """Policy "release" for FSDP2 on CPU: sharding is for memory, which only shrinks with ranks
    once malloc gives the freed per-block buffers back (a step costs more page faults for it)."""
    if set_cpu_allocator("release"):
        get_logger().info("FSDP2 on CPU: glibc malloc's mmap threshold fixed at %d KiB, so freed "
                          "buffers go back to the OS (set MALLOC_MMAP_THRESHOLD_ to choose "
                          "another)", MMAP_THRESHOLD // 1024)
