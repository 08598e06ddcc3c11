#!/usr/bin/env bash
# Builds the RingServe images from the repository root: ringserve:cpu (docker/Dockerfile.cpu) and ringserve:cuda
# (docker/Dockerfile.cuda). Needs a Docker engine with BuildKit (built into Docker 20.10 and later); the Dockerfiles
# use only the engine's built-in Dockerfile frontend (no `# syntax=` image to pull).
# Usage: scripts/docker-build.sh [cpu|cuda|all] [extra `docker build` arguments, e.g. --build-arg TORCH_CUDA=cu130]
# The tag defaults to the package version; TAG=... overrides it. Both images are also tagged :cpu / :cuda.
set -euo pipefail
cd "$(dirname "$0")/.."

which=${1:-all}
[ $# -gt 0 ] && shift
case "$which" in
  cpu | cuda | all) ;;
  *) echo "usage: $0 [cpu|cuda|all] [docker build arguments...]" >&2; exit 2 ;;
esac
if ! docker info >/dev/null 2>&1; then
  echo "scripts/docker-build.sh: no Docker engine is reachable (\`docker info\` fails): start one, or point" \
    "DOCKER_HOST at one, then run this again" >&2
  exit 1
fi

# A docker CLI whose `docker build` is BuildKit: one with the buildx plugin, or a 20.10-22.x client, which has BuildKit
# built in (a newer client without buildx would fail the build). DOCKER=... names one.
buildkit_cli() {
  local cli major
  for cli in ${DOCKER:-} docker /usr/bin/docker; do
    command -v "$cli" >/dev/null || continue
    if "$cli" buildx version >/dev/null 2>&1; then echo "$cli"; return; fi
    major=$("$cli" version --format '{{.Client.Version}}' 2>/dev/null | cut -d. -f1) || true
    if [ -n "$major" ] && [ "$major" -ge 20 ] && [ "$major" -lt 23 ]; then echo "$cli"; return; fi
  done
  echo "scripts/docker-build.sh: no docker CLI with BuildKit (install the buildx plugin, or name one with DOCKER=)" >&2
  exit 1
}
cli=$(buildkit_cli)

version=$(sed -n 's/^__version__ = "\([^"]*\)".*/\1/p' ringserve/__init__.py | head -n 1)
tag=${TAG:-$version}
build() {  # variant (cpu|cuda), then extra docker build arguments
  local variant=$1; shift
  echo "==> building ringserve:${variant} (also ringserve:${tag}-${variant}) from docker/Dockerfile.${variant}"
  DOCKER_BUILDKIT=1 "$cli" build -f "docker/Dockerfile.${variant}" \
    -t "ringserve:${variant}" -t "ringserve:${tag}-${variant}" "$@" .
}
if [ "$which" = cpu ] || [ "$which" = all ]; then build cpu "$@"; fi
if [ "$which" = cuda ] || [ "$which" = all ]; then build cuda "$@"; fi
