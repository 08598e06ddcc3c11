"""The worker's model runner: applies StepPlan deltas to the persistent batch, runs the forward pass, samples.

A StepPlan (docs/contracts.md) names slots, not requests; `InputBatch` keeps every slot's tokens, block table and
sampling parameters across steps, so a decode step carries only (slot, start, 1) and is prepared with vectorized
gathers.
"""

from __future__ import annotations

import atexit
import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from ringserve.workers.attention import attention_metadata_scope, get_attention_backend
from ringserve.workers.cuda_graphs import GRAPH_MODES, DecodeGraphs, GraphMode
from ringserve.workers.input_batch import InputBatch
from ringserve.workers.model import KVCache, LlamaConfig, LlamaForCausalLM
from ringserve.workers.sampler import Sampler
from ringserve.workers.speculative import Proposer, verify_drafts
from ringserve.workers.speculative.tree import DraftTree, chunk_tree_mask, compact_accepted_kv, verify_tree

_GIB = 1 << 30
log = logging.getLogger(__name__)


class NewRequestLike(Protocol):
    """`_core.NewRequestData` (docs/contracts.md): a slot's tokens and blocks, and its `_core.SamplingParams`."""

    slot: int
    token_ids: Any  # int32 array-like
    block_ids: Any
    num_computed_tokens: int
    num_prompt_tokens: int
    sampling: Any  # _core.SamplingParams: every sampling field by name
    suppress_token_ids: Any  # int32 array-like


class BlockAppendLike(Protocol):
    slot: int
    block_ids: Any


class StepPlanLike(Protocol):
    """What the runner reads from `_core.StepPlan`; plain Python objects of this shape work too."""

    step_id: int
    new_requests: Sequence[NewRequestLike]
    block_appends: Sequence[BlockAppendLike]
    sched_slots: Any
    sched_start: Any
    sched_len: Any
    sched_sample: Any
    finished_slots: Any
    # Layout version 3 (speculative decoding); plain objects without them plan no lookahead.
    # sched_lookahead: Any; trim_slots: Any; trim_num_blocks: Any


class NewRequest:
    """A `NewRequestLike` built in process (tests, benchmarks, offline use) rather than decoded from a record.

    Sampling fields come by name (`temperature=0.0`, ...) or whole (`sampling=`), with the records' defaults
    (`_core.SamplingParams`): temperature 1.0 samples, so a greedy caller says temperature=0.0.
    """

    def __init__(
        self,
        slot: int,
        token_ids: np.ndarray,
        block_ids: np.ndarray,
        num_computed_tokens: int = 0,
        num_prompt_tokens: int | None = None,  # None = the whole of token_ids is the prompt
        suppress_token_ids: np.ndarray | None = None,
        sampling: Any = None,
        **sampling_fields: Any,
    ) -> None:
        from ringserve import _core  # built from csrc/; imported on use so importing workers/ needs no build

        self.slot = slot
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.num_computed_tokens = num_computed_tokens
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.suppress_token_ids = np.zeros(0, np.int32) if suppress_token_ids is None else suppress_token_ids
        self.sampling = sampling if sampling is not None else _core.SamplingParams(**sampling_fields)


@dataclass
class BlockAppend:
    slot: int
    block_ids: np.ndarray


@dataclass
class StepPlan:
    """A `StepPlanLike` built in process; the engine's come from `_core.decode_worker_command`."""

    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    block_appends: list[BlockAppend] = field(default_factory=list)
    sched_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    sched_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    sched_len: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    sched_sample: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    finished_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    sched_lookahead: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    trim_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    trim_num_blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


@dataclass
class StepOutput:
    """The tokens of each slot that had sched_sample set, in schedule order: one each, or token_counts[i] each
    (accepted drafts, then the target's token) when the plan had lookahead."""

    step_id: int
    slots: np.ndarray  # int32
    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32
    top_token_ids: np.ndarray | None = None  # int32 [rows, n], -1 padded; None when no row asked
    top_logprobs: np.ndarray | None = None  # float32 [rows, n]
    token_counts: np.ndarray | None = None  # int32 [slots]; None = one token each
    num_proposed: np.ndarray | None = None  # int32 [slots]: draft tokens verified


def kv_blocks_for_memory(config: LlamaConfig, block_size: int, dtype: torch.dtype, memory_gib: float) -> int:
    blocks = int(memory_gib * _GIB) // config.kv_bytes_per_block(block_size, dtype)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_gib={memory_gib} holds no KV block of {block_size} tokens; raise it")
    return blocks


def freeze_long_lived_objects() -> None:
    """Moves every object alive now (modules, tensors, imported code) out of the garbage collector's generations, so
    the collections that the step loop's allocations trigger walk only what the steps allocate: a worker calls this
    once its model and runner are built, before serving (at 135M parameters the full collections of an unfrozen heap
    cost about a tenth of a single-stream decode step)."""
    gc.collect()
    gc.freeze()
    # Frozen objects are never collected: hand them back at exit, so extension modules that check for leaked
    # instances at teardown (nanobind's) find them released.
    atexit.register(gc.unfreeze)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gib: float = 1.0,
        device: torch.device | str = "cpu",
        seed: int = 0,
        attention_backend: str = "auto",
        kv_cache_dtype: torch.dtype | None = None,
        proposer: Proposer | None = None,
        kv_cache: KVCache | None = None,
        kv_connector: Any = None,
        cuda_graphs: GraphMode = "auto",
        max_graph_batch: int = 256,
    ) -> None:
        model.fuse_projections()  # inference only from here on: one GEMM for q/k/v and one for gate/up
        self.model = model
        self.config = model.config  # with tensor parallelism: this rank's shard (its KV heads size the cache)
        self.device = torch.device(device)
        self.block_size = block_size
        kv_dtype = kv_cache_dtype or next(model.parameters()).dtype
        if kv_cache is not None:
            num_kv_blocks = kv_cache.num_blocks
        if num_kv_blocks is None:
            num_kv_blocks = kv_blocks_for_memory(self.config, block_size, kv_dtype, kv_cache_memory_gib)
        self.num_kv_blocks = num_kv_blocks
        backend = get_attention_backend(attention_backend, self.device)
        graph_mode = self._graph_mode(cuda_graphs, backend, kv_cache)
        # A given cache (e.g. views into a KV connector's shared region) must match num_kv_blocks and block_size.
        # Decode graphs get one more block, which no request owns: their padding rows write and read it.
        self.kv_cache = kv_cache or KVCache.allocate(
            self.config, num_kv_blocks + (graph_mode != "off"), block_size, kv_dtype, self.device
        )
        self.kv_connector = kv_connector  # workers/kv_connector.KvConnector, for KvPull records (disaggregation)
        self.kv_pulls: list[Any] = []  # KvPulls to run before the next plan
        model.bind_kv_cache(self.kv_cache, backend)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(seed))
        self.batch = InputBatch(block_size, num_kv_blocks, self.config.max_position, self.device)
        self.proposer = proposer  # None: lookahead in a plan is ignored (no drafts, one token per slot)
        self.graphs: DecodeGraphs | None = None
        if graph_mode != "off":
            self.graphs = DecodeGraphs(
                model, block_size=block_size, scratch_block=num_kv_blocks, max_position=self.config.max_position,
                max_batch=max_graph_batch, device=self.device, capture=graph_mode == "auto",
            )  # fmt: skip
            try:
                self.graphs.capture()
            except Exception:  # a model or driver that cannot be captured still serves, eagerly
                log.exception("capturing CUDA graphs of decode steps failed; decode steps run eagerly")
                self.graphs = None

    def _graph_mode(self, requested: GraphMode, backend: Any, kv_cache: KVCache | None) -> GraphMode:
        """With "auto", graphs only where they apply: CUDA, the triton_paged backend (its decode kernel reads
        lengths and tables on the device; gather + SDPA plans on the host), no forward hooks (tensor parallelism's
        all-reduce), a cache of our own (the scratch block)."""
        if requested not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs={requested!r}: must be one of {', '.join(GRAPH_MODES)}")
        if requested == "off":
            return "off"
        hooks = any(m._forward_hooks or m._forward_pre_hooks for m in self.model.modules())
        eligible = backend.name == "triton_paged" and not hooks and kv_cache is None
        if requested == "static":
            if not eligible:
                raise ValueError("static decode buffers need the triton_paged backend, no tensor parallelism and "
                                 "a KV cache of the runner's own")  # fmt: skip
            return "static"
        return "auto" if eligible and self.device.type == "cuda" else "off"

    def tokens_of(self, slot: int) -> list[int]:
        """Every token the slot holds (prompt, outputs and sampled tokens)."""
        return self.batch.tokens_of(slot)

    def apply_plan_deltas(self, plan: StepPlanLike) -> None:
        # Order matters: trims belong to a slot's old occupant; a finished slot may be reused by a new request.
        trim_slots = np.asarray(getattr(plan, "trim_slots", ()), np.int64).reshape(-1)
        if len(trim_slots):
            self.batch.trim_blocks(trim_slots, np.asarray(plan.trim_num_blocks, np.int64).reshape(-1))
        self.batch.remove(np.asarray(plan.finished_slots, np.int64).reshape(-1))
        for req in plan.new_requests:
            self.batch.add(req)
        for append in plan.block_appends:
            self.batch.append_blocks(int(append.slot), append.block_ids)

    def execute(self, plan: StepPlanLike) -> StepOutput:
        self.apply_plan_deltas(plan)
        if self.kv_pulls:
            self._run_kv_pulls()
        slots = np.asarray(plan.sched_slots, np.int64).reshape(-1)
        if not len(slots):
            return StepOutput(plan.step_id, *_empty_result())
        lookahead = np.asarray(getattr(plan, "sched_lookahead", ()), np.int64).reshape(-1)
        if self.proposer is not None and len(lookahead) and lookahead.any():
            return self._execute_speculative(plan, slots, lookahead)
        starts = np.asarray(plan.sched_start, np.int64).reshape(-1)
        lens = np.asarray(plan.sched_len, np.int64).reshape(-1)
        sample = np.asarray(plan.sched_sample, np.bool_).reshape(-1)
        graphs = self.graphs
        if graphs is not None and self.proposer is None and len(slots) <= graphs.max_batch and (lens == 1).all():
            with torch.inference_mode():
                logits = graphs.run(*self.batch.decode_arrays(slots, starts))
                if not sample.all():
                    logits = logits[torch.from_numpy(np.flatnonzero(sample)).to(logits.device)]
            sampled_slots = slots[sample]
        else:
            step = self.batch.prepare(slots, starts, lens, sample)
            with torch.inference_mode(), attention_metadata_scope(step.metadata):
                # The sampler widens to float32 itself where it needs to (exactly), so plain steps skip that copy.
                logits = self.model(step.input_ids, step.positions, float_logits=False)
            if self.proposer is not None:
                self.proposer.observe_step(step.input_ids, step.positions, step.metadata)
            sampled_slots = step.sampled_slots
        if not len(sampled_slots):
            return StepOutput(plan.step_id, *_empty_result())
        if self.batch.plain_greedy(sampled_slots):
            out = self.sampler.greedy(logits)
        else:
            out = self.sampler.sample(logits, self.batch.sampling_batch(sampled_slots))
        tokens = out.token_ids.cpu().numpy()
        self.batch.append_sampled(sampled_slots, tokens)
        return StepOutput(
            plan.step_id,
            sampled_slots.astype(np.int32),
            tokens.astype(np.int32),
            out.logprobs.cpu().numpy().astype(np.float32),
            None if out.top_token_ids is None else out.top_token_ids.cpu().numpy().astype(np.int32),
            None if out.top_logprobs is None else out.top_logprobs.float().cpu().numpy(),
        )

    def _draftable(self, slots: np.ndarray) -> np.ndarray:
        """Rows the acceptance rule covers as is: no penalties (they depend on the accepted prefix), no pending
        min_tokens suppression, no top logprobs. The others decode one token (lossless, just not faster)."""
        p = self.batch.params
        outputs = self.batch.num_tokens[slots] - self.batch.num_prompt_tokens[slots]
        return (
            (p["repetition_penalty"][slots] == 1.0)
            & (p["frequency_penalty"][slots] == 0.0)
            & (p["presence_penalty"][slots] == 0.0)
            & (p["num_logprobs"][slots] == 0)
            & (outputs >= p["min_tokens"][slots])
        )

    def _execute_speculative(self, plan: StepPlanLike, slots: np.ndarray, lookahead: np.ndarray) -> StepOutput:
        assert self.proposer is not None
        starts = np.asarray(plan.sched_start, np.int64).reshape(-1)
        lens = np.asarray(plan.sched_len, np.int64).reshape(-1)
        sample = np.asarray(plan.sched_sample, np.bool_).reshape(-1)
        spec = np.flatnonzero((lookahead > 0) & sample)
        spec = spec[self._draftable(slots[spec])]
        num_drafts = np.zeros(len(slots), np.int64)
        proposals = []
        if len(spec):
            proposals = self.proposer.propose(
                self.batch, slots[spec], lookahead[spec], self.batch.sampling_batch(slots[spec])
            )
            for entry, proposal in zip(spec.tolist(), proposals, strict=True):
                drafts = np.asarray(proposal.token_ids, np.int64)[: lookahead[entry]]
                num_drafts[entry] = len(drafts)
                # A tree's absent nodes (-1) are computed as token 0 and never accepted (verify_tree sees the -1).
                self.batch.stage_drafts(int(slots[entry]), np.maximum(drafts, 0))
        step = self.batch.prepare(slots, starts, lens, sample, num_drafts)
        tree = getattr(self.proposer, "tree", None)
        if tree is not None and len(spec):
            # Tree nodes sit in consecutive lookahead slots but take their depth's RoPE position and see only the
            # prefix and their ancestors.
            ends = np.cumsum(lens + num_drafts)
            positions = step.positions.cpu().numpy().copy()
            masks = {}
            for entry in spec.tolist():
                n = int(num_drafts[entry])
                last = starts[entry] + lens[entry] - 1
                positions[ends[entry] - n : ends[entry]] = last + tree.node_depth[1 : n + 1]
                masks[entry] = torch.from_numpy(chunk_tree_mask(tree, int(starts[entry]), int(lens[entry]), n))
            step.positions = torch.from_numpy(positions).to(step.positions.device)
            step.metadata.tree_masks = {e: m.to(step.positions.device) for e, m in masks.items()}
        with torch.inference_mode(), attention_metadata_scope(step.metadata):
            logits = self.model(step.input_ids, step.positions)
        self.proposer.observe_step(step.input_ids, step.positions, step.metadata)
        sampled = np.flatnonzero(sample)
        if not len(sampled):
            return StepOutput(plan.step_id, *_empty_result())
        # Logits rows come per sampled entry in schedule order: 1 + num_drafts each.
        per = 1 + num_drafts[sampled]
        first_row = np.cumsum(per) - per
        plain = num_drafts[sampled] == 0
        tokens: list[np.ndarray] = [np.zeros(0, np.int32)] * len(sampled)
        logprobs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(sampled)
        top_ids = top_lps = None
        if plain.any():
            rows = torch.from_numpy(first_row[plain]).to(logits.device)
            out = self.sampler.sample(logits[rows], self.batch.sampling_batch(slots[sampled[plain]]))
            plain_tokens = out.token_ids.cpu().numpy().astype(np.int32)
            plain_lps = out.logprobs.cpu().numpy().astype(np.float32)
            for j, i in enumerate(np.flatnonzero(plain).tolist()):
                tokens[i], logprobs[i] = plain_tokens[j : j + 1], plain_lps[j : j + 1]
            if out.top_token_ids is not None and out.top_logprobs is not None:
                top_ids, top_lps = out.top_token_ids.cpu().numpy(), out.top_logprobs.float().cpu().numpy()
        verified_rows = np.flatnonzero(~plain)
        if len(verified_rows):
            entries = sampled[verified_rows]
            index = np.concatenate([np.arange(first_row[i], first_row[i] + per[i]) for i in verified_rows.tolist()])
            by_entry = {e: p for e, p in zip(spec.tolist(), proposals, strict=True)}
            if tree is not None:
                nodes = [np.asarray(by_entry[e].token_ids, np.int64)[: num_drafts[e]] for e in entries.tolist()]
                self._verify_tree(tree, logits, index, slots, entries, nodes, num_drafts, verified_rows, tokens,
                                  logprobs)  # fmt: skip
            else:
                self._verify_chain(logits, index, slots, entries, num_drafts, verified_rows, by_entry, tokens, logprobs)
        counts = np.array([len(t) for t in tokens], np.int32)
        proposed = num_drafts[sampled].astype(np.int32)
        if tree is not None:  # a tree proposes one path's worth of tokens: its depth
            proposed = tree.node_depth[proposed].astype(np.int32)
        for i, entry in enumerate(sampled.tolist()):
            self.batch.append_tokens(int(slots[entry]), tokens[i])
        if top_ids is not None and top_lps is not None:
            # Top-n rows per token; speculating rows never ask for them (see _draftable), so theirs are padding.
            n = top_ids.shape[1]
            full_ids = np.full((int(counts.sum()), n), -1, np.int32)
            full_lps = np.zeros((int(counts.sum()), n), np.float32)
            at = np.cumsum(counts) - counts
            full_ids[at[plain]] = top_ids
            full_lps[at[plain]] = top_lps
            top_ids, top_lps = full_ids, full_lps
        return StepOutput(
            plan.step_id,
            slots[sampled].astype(np.int32),
            np.concatenate(tokens).astype(np.int32),
            np.concatenate(logprobs).astype(np.float32),
            top_ids,
            top_lps,
            counts,
            proposed,
        )

    def _verify_chain(
        self,
        logits: torch.Tensor,
        index: np.ndarray,
        slots: np.ndarray,
        entries: np.ndarray,
        num_drafts: np.ndarray,
        verified_rows: np.ndarray,
        by_entry: dict[int, Any],
        tokens: list[np.ndarray],
        logprobs: list[np.ndarray],
    ) -> None:
        result = verify_drafts(
            logits[torch.from_numpy(index).to(logits.device)],
            num_drafts[entries],
            [self.batch.token_ids[slots[e], self.batch.num_tokens[slots[e]] :][: num_drafts[e]] for e in entries],
            self.batch.sampling_batch(slots[entries]),
            self.sampler,
            [by_entry[e].probs for e in entries.tolist()],
        )
        for j, i in enumerate(verified_rows.tolist()):
            tokens[i], logprobs[i] = result.token_ids[j], result.logprobs[j]

    def _verify_tree(
        self,
        tree: DraftTree,
        logits: torch.Tensor,
        index: np.ndarray,
        slots: np.ndarray,
        entries: np.ndarray,
        node_tokens: list[np.ndarray],
        num_drafts: np.ndarray,
        verified_rows: np.ndarray,
        tokens: list[np.ndarray],
        logprobs: list[np.ndarray],
    ) -> None:
        entry_slots = slots[entries]
        last = self.batch.num_tokens[entry_slots] - 1
        verdict = verify_tree(
            tree,
            logits[torch.from_numpy(index).to(logits.device)],
            num_drafts[entries],
            node_tokens,
            self.batch.sampling_batch(entry_slots),
            self.sampler,
        )
        caches = [(self.kv_cache.k, self.kv_cache.v)]
        own = getattr(self.proposer, "kv_cache", None)  # a draft model's cache holds tree KV too
        if own is not None:
            caches.append((own.k, own.v))
        compact_accepted_kv(caches, self.batch, entry_slots, last, verdict.path)
        for j, i in enumerate(verified_rows.tolist()):
            tokens[i], logprobs[i] = verdict.token_ids[j], verdict.logprobs[j]

    def _run_kv_pulls(self) -> None:
        """Pulls each admitted remote-KV request's prompt blocks; on any failure computes them here instead."""
        from ringserve.workers import kv_connector as kvc

        pulls, self.kv_pulls = self.kv_pulls, []
        rank, world = _tp_rank_and_size()
        for pull in pulls:
            failed = self.kv_connector is None
            if not failed:
                try:
                    peers = kvc.unpack_peer_infos(pull.peer)
                    if len(peers) != world:
                        raise kvc.KvHandshakeError(f"source has {len(peers)} TP ranks, this server {world}")
                    before_bytes, before_s = self.kv_connector.bytes_pulled, self.kv_connector.seconds_pulling
                    self.kv_connector.pull(peers[rank], pull.remote_block_ids, pull.local_block_ids)
                    moved = self.kv_connector.bytes_pulled - before_bytes
                    seconds = max(self.kv_connector.seconds_pulling - before_s, 1e-9)
                    log.info(
                        "KV pull: %d blocks, %d bytes in %.3f ms (%.3f GiB/s)",
                        len(pull.local_block_ids),
                        moved,
                        seconds * 1e3,
                        moved / seconds / (1 << 30),
                    )
                except (kvc.KvTransferError, kvc.KvHandshakeError) as exc:
                    log.warning("KV pull for slot %d failed, computing its prompt locally: %s", pull.slot, exc)
                    failed = True
            if world > 1:  # every rank must take the same path: the fallback forward runs collectives
                flag = torch.tensor([1 if failed else 0], device=self.device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
                failed = bool(flag.item())
            if failed:
                self.compute_prompt_kv(int(pull.slot))

    def compute_prompt_kv(self, slot: int) -> None:
        """Local-prefill fallback: writes the KV of the slot's prompt into its blocks (no sampling)."""
        n = int(self.batch.num_prompt_tokens[slot])
        step = self.batch.prepare(np.array([slot]), np.array([0]), np.array([n]), np.array([False]))
        with torch.inference_mode(), attention_metadata_scope(step.metadata):
            self.model(step.input_ids, step.positions)


def _tp_rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _empty_result() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32)
