#!/usr/bin/env bash
# Sets up .venv if missing and runs the whole test suite (distributed, resume and parity tests
# included). Extra arguments go to pytest, e.g. `bash launch/test.sh -m "not slow" -x`.
set -euo pipefail
LMFORGE_EXTRAS=test source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two workers, each taking a whole file at a time (a module's fixtures are built once): the
# multi-process tests spend most of their time in process start-up, rendezvous and waits, so two
# files at once share two cores well (bench/results/README.md, "The test suite"). Options given
# after these win: `-n 0` runs everything in this process (e.g. for --pdb), `-n 4` on more cores.
exec python -m pytest -n 2 --dist loadfile "$@"
