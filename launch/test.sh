#!/usr/bin/env bash
# Sets up .venv if missing and runs the whole test suite (distributed, resume and parity tests
# included). Extra arguments go to pytest, e.g. `bash launch/test.sh -m "not slow" -x`.
set -euo pipefail
LMFORGE_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest "$@"
