#!/usr/bin/env bash
# Quick check of the CPU image by hand on a machine with a Docker engine (tests/docker/ check more, in CI):
# builds ringserve:cpu, runs it, waits until Docker reports it healthy (the image's gRPC HEALTHCHECK), streams one
# request with `ringserve generate` inside the container (and from the host when .venv has ringserve), asks the
# OpenAI-compatible HTTP API's /health and /v1/models through its published port, reads the metrics endpoint, then
# stops it with SIGTERM and checks that the server drained and exited 0.
# Usage: docker/smoke.sh    SKIP_BUILD=1 reuses an existing image; IMAGE, PORT, HTTP_PORT, HEALTH_TIMEOUT override.
set -euo pipefail
cd "$(dirname "$0")/.."

image=${IMAGE:-ringserve:cpu}
port=${PORT:-50051}
http_port=${HTTP_PORT:-8000}
health_timeout=${HEALTH_TIMEOUT:-300}
name=ringserve-smoke-$$

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  scripts/docker-build.sh cpu
fi

cleanup() { docker rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
fail() {
  echo "SMOKE FAILED: $*" >&2
  docker logs "$name" 2>&1 | tail -n 50 >&2 || true
  exit 1
}

echo "==> starting $image as $name (gRPC on 127.0.0.1:$port, HTTP on 127.0.0.1:$http_port)"
docker run -d --name "$name" --init --shm-size=1g -p "127.0.0.1:${port}:50051" -p "127.0.0.1:${http_port}:8000" \
  -e RINGSERVE_MAX_NUM_SEQS=8 "$image" --kv-cache-memory-gib 0.25 >/dev/null

echo "==> waiting for the HEALTHCHECK to report healthy (up to ${health_timeout}s)"
deadline=$((SECONDS + health_timeout))
while :; do
  status=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$name")
  [ "$status" = healthy ] && break
  [ "$(docker inspect -f '{{.State.Running}}' "$name")" = true ] || fail "the container exited while starting"
  [ "$SECONDS" -lt "$deadline" ] || fail "not healthy after ${health_timeout}s (status: ${status:-none})"
  sleep 2
done

uid=$(docker exec "$name" id -u)
[ "$uid" != 0 ] || fail "the server runs as root"

echo "==> streaming one request from inside the container"
text=$(docker exec "$name" ringserve generate --stream --max-tokens 16 --temperature 0 "Say hello in one word.")
echo "$text"
[ -n "$(echo "$text" | tr -d '[:space:]')" ] || fail "the stream returned no text"

if [ -x .venv/bin/python ] && .venv/bin/python -c "import ringserve.frontend.cli" 2>/dev/null; then
  echo "==> streaming one request from the host through the published port"
  text=$(.venv/bin/python -m ringserve.frontend.cli generate --host 127.0.0.1 --port "$port" --stream \
    --max-tokens 8 --temperature 0 --raw "The capital of France is")
  echo "$text"
  [ -n "$(echo "$text" | tr -d '[:space:]')" ] || fail "the stream through the published port returned no text"
fi

echo "==> the OpenAI-compatible HTTP API through the published port"
curl -fsS -m 10 "http://127.0.0.1:${http_port}/health" >/dev/null || fail "no /health on :${http_port}"
curl -fsS -m 10 "http://127.0.0.1:${http_port}/v1/models" | grep -q '"object": *"list"' \
  || fail "no model list on :${http_port}/v1/models"

echo "==> reading the Prometheus metrics endpoint"
docker exec "$name" python -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8002/metrics', timeout=5)" \
  || fail "no metrics on :8002"

echo "==> stopping with SIGTERM (docker stop)"
docker stop -t 30 "$name" >/dev/null
code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
[ "$code" = 0 ] || fail "the server exited with $code on SIGTERM, expected 0"
echo "SMOKE OK: $image built, healthy, streamed, stopped cleanly"
