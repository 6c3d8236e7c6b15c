#!/usr/bin/env bash
# Runs a command on this AVX-512 machine as on the AVX2 kind (bench/README.md, "Another CPU
# kind on this one"), e.g.
#   bash bench/avx2_proxy.sh python -m bench.train_bench --rounds 3
#   bash bench/avx2_proxy.sh bash launch/test.sh
set -euo pipefail
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
# A cache of inductor's own: with the default one warm from AVX-512 runs, compiled code came back
# wrong under the cap (a loss of -0.0, an index out of bounds, a segfault; torch 2.13), and right
# from a cache of its own.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_avx2_$(id -u)}"
exec "$@"
