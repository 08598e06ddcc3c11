#!/usr/bin/env bash
# One command: set up everything, then serve the embedded SmolLM2-135M-Instruct on localhost:50051.
# Extra arguments go to `ringserve serve` (see `.venv/bin/ringserve serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/ringserve serve "$@"
