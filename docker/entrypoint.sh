#!/bin/sh
# Entrypoint of the RingServe images (tests/integration/test_docker_entrypoint.py runs this same script outside Docker).
#   docker run IMAGE [FLAGS...]                       -> ringserve serve FLAGS...
#   docker run IMAGE serve|router|generate|... ARGS   -> that ringserve subcommand
#   docker run IMAGE PROGRAM [ARGS...]                -> PROGRAM (e.g. sh, to look around)
# Every `ringserve serve` flag also reads a RINGSERVE_* variable (--max-num-seqs <- RINGSERVE_MAX_NUM_SEQS); a flag
# given on the command line wins over its variable.
set -eu

# RingServe's shared-memory rings live in /dev/shm and take about 100 MiB for one engine; Docker's default /dev/shm is
# 64 MiB, and a ring write past a tmpfs limit is a SIGBUS in the middle of serving, so refuse to start instead.
MIN_SHM_MIB=128

shm_too_small() {
  [ -d /dev/shm ] || return 1
  shm_kib=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { print $2 }')
  [ -n "$shm_kib" ] && [ "$shm_kib" -lt $((MIN_SHM_MIB * 1024)) ]
}

case "${1:-}" in
  "" | -*) set -- serve "$@" ;;
esac

case "$1" in
  serve | router | generate | tokenize | model-info | stats) ;;
  *) exec "$@" ;;
esac

if [ "$1" = serve ]; then
  # Reachable through published ports only when listening on every interface; RINGSERVE_HOST or --host overrides.
  RINGSERVE_HOST=${RINGSERVE_HOST:-0.0.0.0}
  export RINGSERVE_HOST
  if shm_too_small; then
    echo "ringserve: /dev/shm holds $((shm_kib / 1024)) MiB; RingServe needs at least ${MIN_SHM_MIB} MiB for its" \
      "shared-memory rings: run the container with --shm-size=1g (docker run) or shm_size: 1gb (compose)" >&2
    exit 2
  fi
fi

# exec: the server replaces this shell, so the SIGTERM of `docker stop` reaches it; it then drains in-flight streams
# (--shutdown-grace), stops the engine and workers, removes its shared memory and exits 0.
if command -v ringserve >/dev/null 2>&1; then
  exec ringserve "$@"
fi
exec python3 -m ringserve.frontend.cli "$@"  # a source checkout with the development layout has no console script
