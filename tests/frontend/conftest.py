"""Fixtures for frontend tests: the real GGUF tokenizer (when RINGSERVE_TEST_GGUF is set), a tiny one, and a server
over a scripted engine (`harness`; a test module may override it with another engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from frontend_testkit import (
    Harness,
    ScriptedEngine,
    build_tiny_tokenizer,
    completion_chunks,
    real_gguf_path,
    start_harness,
)
from ringserve.frontend.text.tokenizer import ModelTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def real_tokenizer() -> ModelTokenizer:
    path = real_gguf_path()
    if path is None:
        pytest.skip("set RINGSERVE_TEST_GGUF to a .gguf file")
    return load_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> ModelTokenizer:
    return build_tiny_tokenizer()


@pytest.fixture
async def harness(tiny_tokenizer: ModelTokenizer) -> AsyncIterator[Harness]:
    h = await start_harness(tiny_tokenizer, ScriptedEngine(completion_chunks(tiny_tokenizer)))
    yield h
    await h.channel.close()
    await h.server.stop(grace=None)
