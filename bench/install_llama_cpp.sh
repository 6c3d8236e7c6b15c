#!/usr/bin/env bash
# llama.cpp for the llama.cpp checks of tests/test_gguf.py (they skip, saying why, without it):
# llama-cpp-python built from its sdist (llama.cpp itself, vendored, CPU backend) into the
# Python that runs the tests: a build for this machine (no prebuilt wheel) is what the checks
# should run. ~30 min on 2 cores (the checks were run with a wheel built so from the sdist).
#
#   bash bench/install_llama_cpp.sh            # the version the checks were written against
#   bash bench/install_llama_cpp.sh SDIST.tar.gz  # a local sdist (offline)
#   PYTHON=.venv/bin/python bash bench/install_llama_cpp.sh
set -euo pipefail
PYTHON=${PYTHON:-python}
VERSION=0.3.36
SOURCE=${1:-llama-cpp-python==$VERSION}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
"$PYTHON" -m pip install --no-binary llama-cpp-python "$SOURCE"
"$PYTHON" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'installed')"
