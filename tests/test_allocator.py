"""pipeline.hardware.set_cpu_allocator, as parallelize applies it: glibc malloc's policy for a
training process's large blocks, checked by the page faults a 64 MiB tensor costs when it is
allocated again after being freed (a step's buffers, step after step). Each case runs in a fresh
process: mallopt's settings last for the process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.common import ROOT

PAGES = 2**26 // 4096  # pages of the 64 MiB buffer: above glibc's largest mmap threshold

SCRIPT = """
import resource, sys, torch
from model import GPT, ModelConfig
from pipeline.distributed import DistInfo
from pipeline.hardware import set_cpu_allocator
from pipeline.parallelize import Precision, parallelize

how = sys.argv[1]
applied = None
if how == "parallelize":
    cpu = torch.device("cpu")
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, d_model=16, d_mlp=32,
                      max_seq_len=8)
    parallelize(GPT(cfg), DistInfo(0, 0, 1, cpu), parallel="none",
                precision=Precision(torch.float32, cpu), compile_model=False,
                activation_checkpointing=False)
elif how != "default":
    applied = set_cpu_allocator(how)

def faults_of_one_buffer():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(2**24).fill_(1.0)  # 64 MiB of fp32, freed at once
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

faults_of_one_buffer()
print(applied, faults_of_one_buffer())
"""


def second_buffer_faults(how: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=ROOT, check=True, timeout=120,
                         capture_output=True, text=True, env={**os.environ, **env}).stdout
    applied, faults = out.split()[-2:]
    return applied, int(faults)


def test_glibc_default_faults_every_large_buffer_in_again():
    """The cost "keep" removes: without it every fresh 64 MiB buffer is faulted in page by page
    (if this fails, malloc here is not glibc's and the cases below prove nothing)."""
    assert second_buffer_faults("default")[1] >= 0.9 * PAGES


def test_keep_reuses_freed_blocks_without_page_faults():
    applied, faults = second_buffer_faults("keep")
    assert applied == "True"
    assert faults < 0.05 * PAGES


def test_parallelize_keeps_blocks_for_an_unsharded_cpu_run():
    assert second_buffer_faults("parallelize")[1] < 0.05 * PAGES


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
