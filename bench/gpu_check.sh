#!/usr/bin/env bash
# The GPU path in one call, on any CUDA machine, from the repository root (about 5-10 minutes):
#   bash bench/gpu_check.sh               # lmforge env, 1-GPU step, >= 2 GPUs: DDP/FSDP2/resume,
#                                         # FSDP2 memory vs plan, then train_bench's shape A vs
#                                         # GPT-2 ref. and HF Llama
#   bash bench/gpu_check.sh --cpu-smoke   # the same code path on CPU/gloo, tiny shapes
# Python: one whose torch already sees CUDA (a system install is reused, with the remaining
# dependencies added in .venv-gpu), else ./.venv created by launch/env.sh with PyPI's default
# (CUDA) torch wheel. Exits non-zero on any failure; every stage runs under a timeout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export WANDB_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
has_cuda='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
# transformers: train_bench's HF Llama reference (the `hf` extra).
deps='import numpy, tiktoken, safetensors, tqdm, matplotlib, transformers'
if [ -x .venv/bin/python ] && .venv/bin/python -c "$has_cuda" 2>/dev/null; then
    PY=.venv/bin/python
    "$PY" -c "$deps" 2>/dev/null || "$PY" -m pip install -q -e ".[hf]"
elif python3 -c "$has_cuda" 2>/dev/null; then
    PY=python3
    if ! python3 -c "$deps" 2>/dev/null; then
        # Keep the system's CUDA torch; install only what lmforge adds on top of it.
        [ -x .venv-gpu/bin/python ] || python3 -m venv --system-site-packages .venv-gpu
        .venv-gpu/bin/pip install -q -e ".[hf]"
        PY=.venv-gpu/bin/python
    fi
else
    export LMFORGE_TORCH="${LMFORGE_TORCH:-torch}" LMFORGE_EXTRAS=hf
    # shellcheck disable=SC1091
    source launch/env.sh
    PY=python
fi
echo "=== lmforge env"
timeout 180 "$PY" -m launch.cli env
echo "=== gpu_check"
timeout 540 "$PY" -m bench.gpu_check "$@"
# Issue 20: FSDP2's peak memory per rank (max_memory_allocated on CUDA) next to the planner's.
echo "=== fsdp_memory"
if [[ " $* " == *" --cpu-smoke "* ]]; then
    mem=(--device cpu --ranks 1 2 --steps 2 --d-model 128 --n-layer 2 --n-head 4)
else
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
    mem=(--device cuda --ranks 1)
    [ "$gpus" -ge 2 ] && mem+=(2)
fi
timeout 600 "$PY" -m bench.fsdp_memory "${mem[@]}"
# Shape A of issue 11 on this device: tok/s, MFU and peak memory (max_memory_allocated on CUDA)
# of lmforge eager/compiled against the GPT-2 reference and HF Llama, in auto's dtype (bf16).
echo "=== train_bench (shape A)"
if [[ " $* " == *" --cpu-smoke "* ]]; then
    bench=(--smoke --shapes A --no-memory --device cpu)
else
    bench=(--shapes A --rounds 1 --no-memory --device cuda)
fi
timeout 360 "$PY" -m bench.train_bench "${bench[@]}"
