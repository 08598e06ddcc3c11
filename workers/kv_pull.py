"""The decode side of disaggregation: pull an admitted request's prompt KV from its prefill server, or compute it.

The engine sends a KvPull record before the plan that admits the slot; the runner runs the queued pulls before it
applies that plan's schedule. Any transfer or handshake failure falls back to a local prefill of the prompt, so a
request never fails because its KV could not be moved.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from ringserve.workers import kv_connector as kvc
from ringserve.workers.attention import attention_metadata_scope
from ringserve.workers.input_batch import InputBatch

log = logging.getLogger(__name__)


def run_kv_pulls(pulls: list[Any], connector: Any, batch: InputBatch, model: torch.nn.Module,
                 device: torch.device) -> None:  # fmt: skip
    """Pulls each request's prompt blocks through `connector` (a workers/kv_connector.KvConnector, or None);
    on any failure computes them here instead."""
    rank, world = _tp_rank_and_size()
    for pull in pulls:
        failed = connector is None or not _pull(pull, connector, rank, world)
        if world > 1:  # every rank must take the same path: the fallback forward runs collectives
            flag = torch.tensor([1 if failed else 0], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            failed = bool(flag.item())
        if failed:
            compute_prompt_kv(batch, model, int(pull.slot))


def _pull(pull: Any, connector: Any, rank: int, world: int) -> bool:
    """One pull of this rank's share; False (logged) where the transfer or the handshake failed."""
    try:
        peers = kvc.unpack_peer_infos(pull.peer)
        if len(peers) != world:
            raise kvc.KvHandshakeError(f"source has {len(peers)} TP ranks, this server {world}")
        before_bytes, before_s = connector.bytes_pulled, connector.seconds_pulling
        connector.pull(peers[rank], pull.remote_block_ids, pull.local_block_ids)
        moved = connector.bytes_pulled - before_bytes
        seconds = max(connector.seconds_pulling - before_s, 1e-9)
        log.info(
            "KV pull: %d blocks, %d bytes in %.3f ms (%.3f GiB/s)",
            len(pull.local_block_ids),
            moved,
            seconds * 1e3,
            moved / seconds / (1 << 30),
        )
        return True
    except (kvc.KvTransferError, kvc.KvHandshakeError) as exc:
        log.warning("KV pull for slot %d failed, computing its prompt locally: %s", pull.slot, exc)
        return False


def compute_prompt_kv(batch: InputBatch, model: torch.nn.Module, slot: int) -> None:
    """Local-prefill fallback: writes the KV of the slot's prompt into its blocks (no sampling)."""
    n = int(batch.num_prompt_tokens[slot])
    step = batch.prepare(np.array([slot]), np.array([0]), np.array([n]), np.array([False]))
    with torch.inference_mode(), attention_metadata_scope(step.metadata):
        model(step.input_ids, step.positions)


def _tp_rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
