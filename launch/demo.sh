#!/usr/bin/env bash
# Sets up .venv if missing and runs the quickstart: prepare -> train -> eval -> sample on the
# built-in corpus, offline. Extra arguments go to `lmforge demo`. The `hf` extra (transformers)
# is installed too, so the `lmforge export` the demo suggests also writes tokenizer.json.
set -euo pipefail
LMFORGE_EXTRAS=hf source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export WANDB_MODE="${WANDB_MODE:-disabled}"
exec lmforge demo "$@"
