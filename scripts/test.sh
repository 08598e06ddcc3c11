#!/usr/bin/env bash
# One command: set up (with test dependencies), then run every test: ruff, the C++ unit tests
# (plain, AddressSanitizer+UndefinedBehaviorSanitizer, ThreadSanitizer for the rings) and pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
# shellcheck disable=SC1091
. .venv/bin/activate

echo "==> ruff (${SECONDS}s in)"
ruff check .

echo "==> Docker files (hadolint; docker compose config when a compose client is present)"
hadolint docker/Dockerfile.cpu docker/Dockerfile.cuda tests/docker/images/Dockerfile.*
compose=()
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null; then
  compose=(docker-compose)  # the standalone client (e.g. Debian's docker-compose) validates the same file
fi
if [ ${#compose[@]} -gt 0 ]; then
  for profile in single observability disagg; do
    "${compose[@]}" -f docker/compose.yaml --profile "$profile" config -q
  done
else
  echo "    skipped \`docker compose config\`: no compose client yet (tests/docker/ install one with the engine)"
fi

echo "==> C++ unit tests (ctest; ${SECONDS}s in)"
pybind_dir=$(python -m pybind11 --cmakedir)
cxx_tests() {  # build dir, then extra cmake flags
  local dir=$1; shift
  cmake -S csrc -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Debug -Dpybind11_DIR="$pybind_dir" \
    -DRINGSERVE_BUILD_PYTHON_MODULE=OFF "$@" >/dev/null
  cmake --build "$dir" -j2
}
cxx_tests build/ctest
ctest --test-dir build/ctest --output-on-failure
cxx_tests build/ctest-asan -DRINGSERVE_SANITIZE=address,undefined
ctest --test-dir build/ctest-asan --output-on-failure
cxx_tests build/ctest-tsan -DRINGSERVE_SANITIZE=thread  # the core's tests (rings, engine threads) and the kernels' pool
ctest --test-dir build/ctest-tsan --output-on-failure

echo "==> typings/ringserve/_core.pyi is current (${SECONDS}s in)"
python scripts/gen_core_stub.py --check

echo "==> Python tests (pytest; ${SECONDS}s in)"
RINGSERVE_TEST_GGUF=${RINGSERVE_TEST_GGUF:-$(python -c \
  "from ringserve.frontend.model_source import embedded_model_path; print(embedded_model_path())")}
export RINGSERVE_TEST_GGUF
python -m pytest "$@"
