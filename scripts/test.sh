#!/usr/bin/env bash
# One command: set up (with test dependencies), then run every test: ruff, the C++ unit tests
# (plain, AddressSanitizer+UndefinedBehaviorSanitizer, ThreadSanitizer for the rings) and pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
# shellcheck disable=SC1091
. .venv/bin/activate

# SIMDe's portable AVX-512 headers, for the C++ test of the AVX-512 VNNI kernels on CPUs without AVX-512
# (csrc/tests/cpu_quant_vnni_test.cpp; CMake leaves that test out, with a warning, where they are missing). Installed
# here, before the Docker preparation below starts its own apt-get.
if [ ! -e /usr/include/simde/x86/avx512.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "==> installing libsimde-dev (SIMDe headers for the emulated AVX-512 kernel test)"
  install_simde() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libsimde-dev >/dev/null
  }
  install_simde 2>/dev/null || { apt-get update -qq && install_simde; } \
    || echo "    could not install libsimde-dev: cpu_quant_vnni_test will be skipped"
fi

# The Docker tests' engine, images and trace backend (scripts/docker-env.sh) are got ready in the background while the
# other tests run: much of a cold image build waits on the network and the disk rather than the CPU. tests/docker/ run
# last and wait for it (RINGSERVE_DOCKER_PREPARED: the file that receives its exit status), then find every layer built.
docker_state=${RINGSERVE_DOCKER_STATE:-/tmp/ringserve-docker}
docker_prep=
docker_finish() {
  [ -n "$docker_prep" ] || return 0
  kill -- "-$docker_prep" 2>/dev/null || true  # still building when an earlier step failed
  if grep -q "starting dockerd" "$docker_state/prepare.log" 2>/dev/null; then
    scripts/docker-env.sh down || true  # the engine it started; one that was running before stays running
  fi
}
if [ "${RINGSERVE_DOCKER_TESTS:-1}" != 0 ] && [ $# = 0 ]; then
  mkdir -p "$docker_state"
  export RINGSERVE_DOCKER_PREPARED="$docker_state/prepared.status"
  rm -f "$RINGSERVE_DOCKER_PREPARED"
  # its own process group (setsid), so that docker_finish can stop all of it
  # Arize Phoenix (the observability test's trace backend, on the host) installs alongside: it needs no engine.
  setsid bash -c 'status=0; scripts/docker-env.sh phoenix & phoenix=$!
    { scripts/docker-env.sh up && scripts/docker-env.sh build; } || status=$?; wait "$phoenix" || status=$?
    echo "$status" > "$0.tmp" && mv "$0.tmp" "$0"' "$RINGSERVE_DOCKER_PREPARED" >"$docker_state/prepare.log" 2>&1 &
  docker_prep=$!
  trap docker_finish EXIT
  echo "==> Docker engine and images: getting ready in the background (log: $docker_state/prepare.log)"
fi

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
