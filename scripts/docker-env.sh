#!/usr/bin/env bash
# A Docker engine and the RingServe images for the Docker tests (tests/docker/), on a machine that may have neither.
#   scripts/docker-env.sh up        an engine: the one running, else (root on Debian) Debian's docker.io installed and
#                                   dockerd started in the background; exit 3 with the reason when there is no way
#   scripts/docker-env.sh build     ringserve:cpu from docker/Dockerfile.cpu (and the image the compose tests use in
#                                   place of Prometheus when prom/prometheus cannot be pulled)
#   scripts/docker-env.sh build-cuda  ringserve:cuda from docker/Dockerfile.cuda, then checks inside it that
#                                   `ringserve serve --help` runs and torch, ringserve._core and NCCL's library load;
#                                   not part of the test suite (several GB of CUDA wheels): tests/docker/ run it with
#                                   RINGSERVE_DOCKER_CUDA=1
#   scripts/docker-env.sh phoenix   a virtual environment with Arize Phoenix, the OTLP trace backend the observability
#                                   test sends the server's traces to (versions: tests/docker/phoenix-constraints.txt);
#                                   kept under the cache folder, made again only when that file changes; prints its path
#   scripts/docker-env.sh down      stops what `up` started (containers it left are stopped by dockerd)
# Where Docker Hub is unreachable, `build` makes a stand-in for the python base image (scripts/docker-base-image.sh)
# and, where download.pytorch.org is unreachable, serves the torch CPU wheel that pip finds here to the build from a
# PEP 503 index on 127.0.0.1 (`docker build --network host`). The engine keeps the build cache: a second build
# reuses every layer whose inputs did not change. Where nvidia/cuda cannot be pulled, `build-cuda` builds on the same
# stand-in base (Debian's Python instead of Ubuntu's; torch's CUDA wheels bring their own CUDA libraries and NCCL), and
# where download.pytorch.org is unreachable it installs PyPI's torch, the CUDA 13.0 build.
# When the base has this machine's Debian release and Python minor and the checkout's native parts are built
# (build/native, scripts/build-native.sh), `build` packs them into a wheel and ringserve:cpu installs it
# (--build-arg RINGSERVE_WHEEL=prebuilt) instead of compiling the C++ again; RINGSERVE_DOCKER_WHEEL=source compiles.
# RINGSERVE_DOCKER_STATE (default /tmp/ringserve-docker) holds the logs and what `up` started.
set -euo pipefail
cd "$(dirname "$0")/.."

state=${RINGSERVE_DOCKER_STATE:-/tmp/ringserve-docker}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/ringserve-docker
python_image=$(sed -n 's/^ARG PYTHON_IMAGE=//p' docker/Dockerfile.cpu)
standin_base=local/python:3.11-slim-bookworm
mkdir -p "$state"

no_engine() { echo "no Docker engine: $*" >&2; exit 3; }
t() { local s=$SECONDS; "$@"; echo "    [$((SECONDS - s))s] $*"; }

up() {
  if docker info >/dev/null 2>&1; then
    echo "using the running Docker engine"
    return
  fi
  [ "$(id -u)" = 0 ] || no_engine "none is running and installing one needs root"
  command -v apt-get >/dev/null || no_engine "none is running and there is no apt-get to install docker.io with"
  if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v mmdebstrap >/dev/null
  then
    echo "==> installing Debian's docker.io, docker-compose, mmdebstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >"$state/apt.log" 2>&1 && apt-get install -y -qq --no-install-recommends \
      docker.io docker-compose mmdebstrap iptables >>"$state/apt.log" 2>&1 \
      || no_engine "installing docker.io failed (see $state/apt.log)"
  fi
  echo "==> starting dockerd (log: $state/dockerd.log)"
  setsid /usr/sbin/dockerd >"$state/dockerd.log" 2>&1 < /dev/null &
  echo $! > "$state/dockerd.pid"
  for _ in $(seq 1 60); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$(cat "$state/dockerd.pid")" 2>/dev/null || no_engine "dockerd exited: $(tail -n 3 "$state/dockerd.log")"
    sleep 1
  done
  docker info >/dev/null 2>&1 || { down; no_engine "dockerd did not answer within 60s"; }
  docker info --format '    engine {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}}'
}

down() {
  [ -f "$state/dockerd.pid" ] || return 0
  pid=$(cat "$state/dockerd.pid")
  if kill -0 "$pid" 2>/dev/null; then
    echo "==> stopping dockerd ($pid); it stops its containers and containerd"
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  fi
  rm -f "$state/dockerd.pid"
}

pullable() {  # image: present, or pulled within 2 minutes
  docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1
}

base_image() {  # prints the image to build on: the official one when it can be had, else the stand-in
  if pullable "$python_image"; then
    echo "$python_image"
    return
  fi
  echo "==> $python_image cannot be pulled: the stand-in $standin_base (log: $state/base.log)" >&2
  if ! command -v mmdebstrap >/dev/null; then  # an engine that was running already, on a machine without mmdebstrap
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >"$state/apt.log" 2>&1 \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        mmdebstrap; } >>"$state/apt.log" 2>&1 || { echo "installing mmdebstrap failed (see $state/apt.log)" >&2; exit 1; }
  fi
  t scripts/docker-base-image.sh "$standin_base" >"$state/base.log" 2>&1 \
    || { tail -n 30 "$state/base.log" >&2; exit 1; }
  echo "$standin_base"
}

index_pid=
stop_index() { [ -z "$index_pid" ] || kill "$index_pid" 2>/dev/null || true; }

torch_index() {  # sets index_url, the torch index for the build: PyTorch's, else a local one (started here)
  local port wheel version
  index_url=$(sed -n 's/^ARG TORCH_INDEX_URL=//p' docker/Dockerfile.cpu)
  if curl -fsS -m 20 -o /dev/null "$index_url/torch/"; then
    return
  fi
  version=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu)
  mkdir -p "$cache/torch-index/torch"
  if ! compgen -G "$cache/torch-index/torch/torch-${version}-cp311-*.whl" >/dev/null; then
    echo "==> $index_url is unreachable: downloading torch==$version for the local index" >&2
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 "torch==${version}" \
      -d "$cache/torch-index/torch" >&2
  fi
  # The URL is a build argument, part of the cache key of every later layer: a fixed port keeps it the same across
  # builds (another port, when that one is taken, costs the runtime layers a rebuild).
  port=$(python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server binds: a just-stopped index may linger
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' "${RINGSERVE_TORCH_INDEX_PORT:-47651}")
  python3 -m http.server "$port" --bind 127.0.0.1 --directory "$cache/torch-index" >"$state/index.log" 2>&1 &
  index_pid=$!
  for _ in $(seq 1 40); do curl -fsS -o /dev/null "http://127.0.0.1:$port/torch/" 2>/dev/null && break; sleep 0.25; done
  wheel=$(cd "$cache/torch-index/torch" && ls torch-"${version}"-cp311-*.whl)
  index_url="http://127.0.0.1:$port/"
  echo "==> serving $wheel on $index_url"
}

wheel_from() {  # base image: prints `prebuilt` once this checkout's native build is packed into build/docker-wheel/,
                # or `source` (the image compiles it) where that build cannot serve the base (RINGSERVE_DOCKER_WHEEL=source
                # always compiles in the image)
  local cache=build/native/CMakeCache.txt here there drift cmake_bin ninja_bin
  [ "${RINGSERVE_DOCKER_WHEEL:-auto}" != source ] && [ -f "$cache" ] && [ -x .venv/bin/python ] \
    || { echo source; return; }
  # The wheel's native modules were built here: usable in the image only on the same Debian release (glibc,
  # libstdc++, g++) and the same Python minor (the extension ABI).
  here="$(. /etc/os-release && echo "$ID $VERSION_ID") $(.venv/bin/python -c 'import sys; print(*sys.version_info[:2])')"
  there=$(docker run --rm --entrypoint sh "$1" -c '. /etc/os-release && echo "$ID $VERSION_ID" \
    "$(python -c "import sys; print(*sys.version_info[:2])")"') || { echo source; return; }
  if [ "$here" != "$there" ]; then
    echo "==> the image compiles RingServe: $1 is $there, this machine $here" >&2
    echo source
    return
  fi
  # The code generated from protos/ and the bindings must come from the generator versions the image pins.
  drift=$(.venv/bin/python - docker/constraints.txt <<'PY'
import sys
from importlib.metadata import version
pins = dict(line.strip().split("==") for line in open(sys.argv[1]) if "==" in line and not line.startswith("#"))
print(*(f"{name} {version(name)} (pinned: {pins[name]})" for name in ("grpcio-tools", "protobuf", "pybind11")
        if version(name) != pins[name]), sep=", ")
PY
)
  if [ -n "$drift" ]; then
    echo "==> the image compiles RingServe: this checkout was built with $drift" >&2
    echo source
    return
  fi
  # Packed by scikit-build-core in build/native, with the CMake and Ninja that configured it (another version of
  # either would rebuild everything), so that it finds every object up to date and only packs. SOURCE_DATE_EPOCH: the
  # same files give the same wheel, byte for byte (not the install's file times), so the image's layers stay cached.
  cmake_bin=$(sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$cache")
  ninja_bin=$(sed -n 's/^CMAKE_MAKE_PROGRAM:[A-Z]*=//p' "$cache")
  rm -rf build/docker-wheel
  echo "==> packing this checkout's native build into build/docker-wheel/ (log: $state/wheel.log)" >&2
  local start=$SECONDS
  if env PATH="$(dirname "$ninja_bin"):$PATH" CMAKE_EXECUTABLE="$cmake_bin" SOURCE_DATE_EPOCH=315532800 \
      .venv/bin/python -m pip wheel -v --no-deps --no-build-isolation --disable-pip-version-check \
      --config-settings=build-dir=build/native \
      --config-settings=ninja.version="==$("$ninja_bin" --version | cut -d. -f1-3)" \
      --wheel-dir build/docker-wheel . >"$state/wheel.log" 2>&1; then
    echo "    [$((SECONDS - start))s] $(cd build/docker-wheel && ls)" >&2
    grep -q 'ninja: no work to do' "$state/wheel.log" || echo "    (it compiled: see $state/wheel.log)" >&2
    echo prebuilt
  else
    echo "    packing failed (see $state/wheel.log): the image compiles RingServe" >&2
    echo source
  fi
}

standin() {  # image wanted, stand-in tag, stand-in Dockerfile, base: the stand-in when the image cannot be pulled
  if pullable "$1"; then return; fi
  echo "==> $1 cannot be pulled: the stand-in $2 from $3"
  t docker build -q --network host --build-arg "BASE_IMAGE=$4" -f "$3" -t "$2" "$(dirname "$3")" >/dev/null
}

build() {
  docker info >/dev/null 2>&1 || no_engine "none is reachable (run \`$0 up\` first)"
  local base prometheus wheel status=0
  base=$(base_image)
  # The observability profile's Prometheus (tests/docker/ run the stand-in in its place where it cannot be pulled),
  # pulled or built alongside ringserve:cpu: they share only the base, and neither keeps both cores busy throughout.
  prometheus=$(sed -n 's/^ *image: *${PROMETHEUS_IMAGE:-\([^}]*\)}.*/\1/p' docker/compose.yaml)
  standin "$prometheus" ringserve-test/prometheus tests/docker/images/Dockerfile.prometheus "$base" \
    >"$state/prometheus.log" 2>&1 &
  local prometheus_pid=$!
  trap stop_index EXIT
  torch_index
  wheel=$(wheel_from "$base")
  echo "==> ringserve:cpu on $base, RingServe's wheel: $wheel (log: $state/build-cpu.log)"
  t scripts/docker-build.sh cpu --progress=plain --network host --build-arg "PYTHON_IMAGE=$base" \
    --build-arg "TORCH_INDEX_URL=$index_url" --build-arg "RINGSERVE_WHEEL=$wheel" >"$state/build-cpu.log" 2>&1 \
    || status=$?
  stop_index
  if [ "$status" != 0 ]; then
    tail -n 40 "$state/build-cpu.log"
    wait "$prometheus_pid" || true
    exit 1
  fi
  docker image inspect ringserve:cpu --format '    ringserve:cpu {{.Size}} bytes'
  wait "$prometheus_pid" || status=$?
  cat "$state/prometheus.log"
  [ "$status" = 0 ] || exit 1
}

build_cuda() {
  docker info >/dev/null 2>&1 || no_engine "none is reachable (run \`$0 up\` first)"
  local base cuda_image torch_cuda args=()
  cuda_image=$(sed -n 's/^ARG CUDA_IMAGE=//p' docker/Dockerfile.cuda)
  torch_cuda=$(sed -n 's/^ARG TORCH_CUDA=//p' docker/Dockerfile.cuda)
  if pullable "$cuda_image"; then
    base=$cuda_image
  else
    base=$(base_image)
    echo "==> $cuda_image cannot be pulled: building on $base"
    args+=(--build-arg "CUDA_IMAGE=$base")
  fi
  if ! curl -fsS -m 20 -o /dev/null "https://download.pytorch.org/whl/${torch_cuda}/torch/"; then
    echo "==> download.pytorch.org is unreachable: PyPI's torch==2.13.0 (its CUDA 13.0 build)"
    args+=(--build-arg TORCH_VERSION=2.13.0 --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
  fi
  echo "==> ringserve:cuda (log: $state/build-cuda.log)"
  t scripts/docker-build.sh cuda --progress=plain --network host "${args[@]}" >"$state/build-cuda.log" 2>&1 \
    || { tail -n 40 "$state/build-cuda.log"; exit 1; }
  docker image inspect ringserve:cuda --format '    ringserve:cuda {{.Size}} bytes'
  echo "==> inside ringserve:cuda: ringserve serve --help, import torch and ringserve._core, load NCCL"
  docker run --rm ringserve:cuda ringserve serve --help >/dev/null
  docker run --rm ringserve:cuda python -c '
import ctypes, glob, site, torch, ringserve._core
libs = sorted(p for d in site.getsitepackages() for p in glob.glob(d + "/nvidia/**/libnccl.so*", recursive=True))
assert libs, "no libnccl in the nvidia-nccl wheel"
nccl = ctypes.CDLL(libs[0])
version = ctypes.c_int()
assert nccl.ncclGetVersion(ctypes.byref(version)) == 0
print(f"    torch {torch.__version__} (CUDA {torch.version.cuda}), NCCL {version.value} from {libs[0]}")'
}

phoenix() {  # no engine needed: Phoenix runs on the host, where the containers reach it as host.docker.internal
  local venv=$cache/phoenix pins=tests/docker/phoenix-constraints.txt start=$SECONDS
  if ! cmp -s "$pins" "$venv/constraints.txt" || [ ! -x "$venv/bin/phoenix" ]; then
    echo "==> installing Arize Phoenix into $venv (log: $state/phoenix-install.log)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$pins" arize-phoenix \
      >"$state/phoenix-install.log" 2>&1 || { tail -n 20 "$state/phoenix-install.log" >&2; rm -rf "$venv"; exit 1; }
    cp "$pins" "$venv/constraints.txt"  # last: marks the environment complete
    echo "    [$((SECONDS - start))s] $("$venv/bin/python" -m pip list --format=freeze 2>/dev/null \
      | grep -i '^arize-phoenix==')" >&2
  fi
  echo "$venv"
}

case "${1:-}" in
  up) up ;;
  build) build ;;
  build-cuda) build_cuda ;;
  phoenix) phoenix ;;
  down) down ;;
  *) echo "usage: $0 up|build|build-cuda|phoenix|down" >&2; exit 2 ;;
esac
