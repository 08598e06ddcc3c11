"""Fixtures for frontend tests: the real GGUF tokenizer (when RINGSERVE_TEST_GGUF is set) and a tiny one."""

from __future__ import annotations

import pytest
from frontend_testkit import build_tiny_tokenizer, real_gguf_path
from ringserve.frontend.tokenizer import ModelTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def real_tokenizer() -> ModelTokenizer:
    path = real_gguf_path()
    if path is None:
        pytest.skip("set RINGSERVE_TEST_GGUF to a .gguf file")
    return load_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_tokenizer() -> ModelTokenizer:
    return build_tiny_tokenizer()
