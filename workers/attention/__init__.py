"""Attention backends behind one interface, plus the per-step metadata they read."""

from ringserve.formats.engine_args import ATTENTION_BACKENDS
from ringserve.workers.attention.backend import AttentionBackend, write_kv
from ringserve.workers.attention.metadata import (
    AttentionMetadata,
    attention_metadata_scope,
    get_attention_metadata,
    set_attention_metadata,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "attention_metadata_scope",
    "get_attention_metadata",
    "set_attention_metadata",
    "write_kv",
]
