"""Fixtures that start the real server (frontend, engine and worker processes) on a loopback port."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import RunningServer, real_model_path, start_server

# These tests compare the served tokens with transformers on the dequantized weights, so the servers they start take
# the float path unless a test asks otherwise: the default (--quantization auto) keeps GGUF blocks on AVX2 CPUs, whose
# agreement with that path is measured in tests/workers/test_quant_ops.py (and served by the Docker image tests).
os.environ.setdefault("RINGSERVE_QUANTIZATION", "none")


@pytest.fixture(scope="session")
def model_path() -> Path:
    return real_model_path()


@pytest.fixture(scope="session")
def server(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One real server shared by the tests that only send requests (the model load is the slow part)."""
    srv = start_server(model_path, tmp_path_factory.mktemp("server"), "--max-num-seqs", "32",
                       "--max-num-batched-tokens", "512", "--num-kv-blocks", "256")  # fmt: skip
    with srv:
        yield srv
        code = srv.stop()
    assert code == 0, f"server exited with {code} on SIGTERM\n{srv.log()}"
