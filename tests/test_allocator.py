"""pipeline.cpu.allocator.set_cpu_allocator, as build_optimizer and parallelize apply it: glibc
malloc's policy for a training process's large blocks, checked by the page faults a 16 MiB buffer
costs when it is allocated again after being freed (a step's buffers, step after step). Each case runs in a fresh
process: mallopt's settings last for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

SIZE = 2**24  # 16 MiB: glibc's default mmaps a block of the size it just freed again
PAGES = SIZE // 4096

SCRIPT = """
import ctypes, resource, sys, torch
from lmforge.pipeline.config import OptimConfig
from lmforge.pipeline.cpu.allocator import set_cpu_allocator
from lmforge.pipeline.optim.optimizers import build_optimizer

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p

SIZE = int(sys.argv[2])

def faults_of_one_buffer():
    # malloc itself, not torch.empty: torch's aligned blocks can be kept from merging back by
    # its own small allocations beside them, a few rounds' noise that training steps outgrow
    # (bench/results/ has the RSS of long runs); the policy is malloc's.
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(SIZE)
    ctypes.memset(p, 1, SIZE)
    libc.free(ctypes.c_void_p(p))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

how = sys.argv[1]
applied = None
if how in ("adamw", "muon"):  # what the trainer builds: keep from the first step's end on
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    opt = build_optimizer(model, OptimConfig(name=how), torch.device("cpu"))
    faults_of_one_buffer()
    before = faults_of_one_buffer()
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    applied = before  # still glibc's default before the step
elif how != "default":
    applied = set_cpu_allocator(how)

faults_of_one_buffer()
print(applied, faults_of_one_buffer())
"""


def second_buffer_faults(how: str, size: int = SIZE, **env: str) -> tuple[str, int]:
    """(what the case printed first, the page faults of allocating and filling a buffer of
    `size` bytes once one has been freed)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT, how, str(size)], cwd=ROOT, check=True,
                         timeout=120, capture_output=True, text=True,
                         env={**os.environ, **env}).stdout
    applied, faults = out.split()[-2:]
    return applied, int(faults)


def test_glibc_default_faults_every_large_buffer_in_again():
    """The cost "keep" removes: without it every fresh 16 MiB buffer is faulted in page by page
    (if this fails, malloc here is not glibc's and the cases below prove nothing)."""
    assert second_buffer_faults("default")[1] >= 0.9 * PAGES


@pytest.mark.parametrize("size", [SIZE, 3 * SIZE])  # 48 MiB: past glibc's largest threshold
def test_keep_reuses_freed_blocks_without_page_faults(size):
    applied, faults = second_buffer_faults("keep", size)
    assert applied == "True"
    assert faults < 0.05 * size // 4096


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_optimizers_first_step_starts_keeping_blocks(optimizer):
    """A training process keeps its blocks once its long-lived state exists (the peak RSS is
    lower than keeping them from the start), so its first step still faults, the later ones not."""
    before, after = second_buffer_faults(optimizer)
    assert int(before) >= 0.9 * PAGES
    assert after < 0.05 * PAGES


def test_release_hands_large_blocks_back_for_fsdp():
    applied, faults = second_buffer_faults("release")
    assert applied == "True"
    assert faults >= 0.9 * PAGES


@pytest.mark.parametrize("var", ["MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"])
def test_a_users_malloc_setting_wins(var):
    """glibc's defaults, set by the user: set_cpu_allocator leaves them, and the faults stay."""
    value = {"MALLOC_MMAP_MAX_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}[var]
    applied, faults = second_buffer_faults("keep", **{var: value})
    assert applied == "False"
    assert faults >= 0.9 * PAGES
