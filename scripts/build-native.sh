#!/usr/bin/env bash
# Builds the native parts of the package (ringserve._core, ringserve._kernels and the code generated from protos/) and
# installs them into ringserve/ of this checkout, where they are gitignored. Fast when nothing changed; scripts/setup.sh
# runs it, and it is the command to rerun after a C++ or .proto change.
# Usage: scripts/build-native.sh [PYTHON]   (default: python3 on PATH, e.g. an activated .venv; it needs pybind11,
#        grpcio-tools and googleapis-common-protos, and CMake >= 3.20 and Ninja on PATH)
set -euo pipefail
python=$(command -v "${1:-python3}")
[[ $python = /* ]] || python="$PWD/$python"  # not resolved further: a venv's python is a link that must stay one
cd "$(dirname "$0")/.."

build=build/native
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DRINGSERVE_BUILD_TESTS=OFF \
  -DPython_EXECUTABLE="$python" -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" >/dev/null
cmake --build "$build"
cmake --install "$build" --component native --prefix . >/dev/null
