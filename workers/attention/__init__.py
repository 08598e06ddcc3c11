"""Attention backends behind one interface, plus the per-step metadata they read."""

from ringserve.workers.attention.backend import ATTENTION_BACKENDS, AttentionBackend, get_attention_backend, write_kv
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
    "get_attention_backend",
    "get_attention_metadata",
    "set_attention_metadata",
    "write_kv",
]
