#!/usr/bin/env bash
# The GPU path in one call, on any CUDA machine, from the repository root (about 5-8 minutes on
# one H200, most of it cold compiles):
#   bash bench/gpu_check.sh               # lmforge env; the 124M step: whole-logits vs chunked
#                                         # loss, the recipe preset, the GPT-2 reference and HF
#                                         # Llama; >= 2 GPUs: DDP/FSDP2 parity, kill + resume
#   bash bench/gpu_check.sh --cpu-smoke   # the same code path on CPU/gloo, tiny shapes
# Python: one whose torch already sees CUDA (a system install is reused, with the remaining
# dependencies added in .venv-gpu), else ./.venv created by launch/env.sh with PyPI's default
# (CUDA) torch wheel. Exits non-zero on any failure; every stage runs under a timeout.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export WANDB_MODE=disabled PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
has_cuda='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
# transformers: the HF Llama reference (the `hf` extra).
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
timeout 180 "$PY" -m lmforge.launch.cli env
echo "=== gpu_check"
timeout 540 "$PY" -m bench.gpu_check "$@"
