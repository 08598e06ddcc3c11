"""The worker's model runner: applies StepPlan deltas to the persistent batch, runs the forward pass, samples.

A StepPlan (docs/contracts.md) names slots, not requests; `InputBatch` keeps every slot's tokens, block table and
sampling parameters across steps, so a decode step carries only (slot, start, 1) and is prepared with vectorized
gathers.
"""

from __future__ import annotations

import atexit
import gc
import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ringserve.workers.attention import attention_metadata_scope
from ringserve.workers.attention.selection import get_attention_backend
from ringserve.workers.cuda_graphs import GRAPH_MODES, DecodeGraphs, GraphMode
from ringserve.workers.input_batch import InputBatch
from ringserve.workers.kv_pull import compute_prompt_kv, run_kv_pulls
from ringserve.workers.model import KVCache, LlamaConfig, LlamaForCausalLM
from ringserve.workers.model.fast_paths import apply_fast_paths
from ringserve.workers.piecewise_graphs import PiecewiseGraphs
from ringserve.workers.pipeline import SampledTokens, split_micro_batches
from ringserve.workers.sampler import Sampler
from ringserve.workers.speculative import Proposer
from ringserve.workers.speculative.execution import SpeculativeStep
from ringserve.workers.step_output import StepOutput

if TYPE_CHECKING:
    from ringserve import _core

_GIB = 1 << 30
log = logging.getLogger(__name__)


def NewRequest(
    slot: int,
    token_ids: Any,
    block_ids: Any,
    num_computed_tokens: int = 0,
    num_prompt_tokens: int | None = None,  # None = the whole of token_ids is the prompt
    suppress_token_ids: Any = None,
    sampling: Any = None,
    **sampling_fields: Any,
) -> Any:
    """A `_core.NewRequestData` built in process (tests, benchmarks, offline use) rather than decoded from a plan.

    Sampling fields come by name (`temperature=0.0`, ...) or whole (`sampling=`), with the records' defaults
    (`_core.SamplingParams`): temperature 1.0 samples, so a greedy caller says temperature=0.0.
    """
    from ringserve import _core  # built from csrc/; imported on use so importing workers/ needs no build

    record = _core.NewRequestData(slot=slot, token_ids=token_ids, block_ids=block_ids,
                                  num_computed_tokens=num_computed_tokens,
                                  num_prompt_tokens=len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
                                  **sampling_fields)  # fmt: skip
    if sampling is not None:
        record.sampling = sampling
    if suppress_token_ids is not None:
        record.suppress_token_ids = suppress_token_ids
    return record


def BlockAppend(slot: int, block_ids: Any) -> Any:
    from ringserve import _core

    return _core.BlockAppend(slot=slot, block_ids=block_ids)


def StepPlan(step_id: int, **fields: Any) -> Any:
    """A `_core.StepPlan` built in process; the engine's come from `_core.decode_worker_command`."""
    from ringserve import _core

    return _core.StepPlan(step_id=step_id, **fields)


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


# What each --cuda-graphs mode takes, as (decode graphs, piecewise graphs): "must" (with capture_graphs=False a
# model that cannot have them is an error), "if" (taken where the model and backend allow), "" (never).
GRAPHS_OF_MODE: dict[str, tuple[str, str]] = {
    "off": ("", ""),
    "decode": ("must", ""),
    "piecewise": ("if", "must"),
    "auto": ("if", "if"),  # piecewise where it can be captured (CUDA), else eager
}


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
        capture_graphs: bool = True,  # False: the graphs' static buffers, padding and cuts run eagerly (any device)
        max_graph_batch: int = 256,
        max_graph_tokens: int = 2048,
        sampled_tokens: SampledTokens | None = None,  # a pipeline stage's: the model is its layers only
    ) -> None:
        apply_fast_paths(model)  # inference only from here on: fused projections, native CPU kernels, huge pages
        self.pipeline = sampled_tokens
        if sampled_tokens is not None:
            model.native_decode = False  # type: ignore[attr-defined]  # a stage's ends send and receive
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
        decode_graphs, pieces = self._graph_modes(cuda_graphs, capture_graphs, backend, kv_cache)
        # A given cache (e.g. views into a KV connector's shared region) must match num_kv_blocks and block_size.
        # Decode graphs get one more block, which no request owns: their padding rows write and read it.
        self.kv_cache = kv_cache or KVCache.allocate(
            self.config, num_kv_blocks + int(decode_graphs), block_size, kv_dtype, self.device
        )
        self.kv_connector = kv_connector  # workers/kv_connector.KvConnector, for KvPull records (disaggregation)
        self.kv_pulls: list[Any] = []  # KvPulls to run before the next plan
        model.bind_kv_cache(self.kv_cache, backend)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(seed))
        self.batch = InputBatch(block_size, num_kv_blocks, self.config.max_position, self.device)
        self.proposer = proposer  # None: lookahead in a plan is ignored (no drafts, one token per slot)
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        if decode_graphs:
            self.graphs = DecodeGraphs(
                model, block_size=block_size, scratch_block=num_kv_blocks, max_position=self.config.max_position,
                max_batch=max_graph_batch, device=self.device, capture=capture_graphs,
            )  # fmt: skip
            try:
                self.graphs.capture()
            except Exception:  # a model or driver that cannot be captured still serves, eagerly
                log.exception("capturing CUDA graphs of decode steps failed; decode steps run eagerly")
                self.graphs = None
        if pieces:
            self.pieces = PiecewiseGraphs(model, max_tokens=max_graph_tokens, device=self.device,
                                          capture=capture_graphs)  # fmt: skip
            try:
                self.pieces.capture()
            except Exception:
                log.exception("capturing piecewise CUDA graphs failed; steps they would replay run eagerly")
                self.pieces = None

    def _graph_modes(
        self, requested: GraphMode, capture: bool, backend: Any, kv_cache: KVCache | None
    ) -> tuple[bool, bool]:
        """(decode graphs, piecewise graphs): what GRAPHS_OF_MODE asks for, where its needs are met. Both kinds need
        the plain model: no forward hooks (tensor parallelism's all-reduce), pipeline stage or mixture of experts
        (its routing picks the experts on the host). Decode graphs also need the triton_paged backend (its decode
        kernel reads lengths and tables on the device; gather + SDPA plans on the host) and a cache of our own (the
        scratch block); piecewise graphs run attention eagerly, so any backend and cache serve. Captured graphs need
        CUDA: elsewhere every step runs eagerly. With `capture=False` (the static buffers run eagerly, for tests)
        the mode must be named (not auto) and its "must" graphs must apply."""
        if requested not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs={requested!r}: must be one of {', '.join(GRAPH_MODES)}")
        wants = GRAPHS_OF_MODE[requested]
        if wants == ("", ""):
            return False, False
        hooks = any(m._forward_hooks or m._forward_pre_hooks for m in self.model.modules()) or self.pipeline is not None
        plain = not hooks and self.config.num_experts == 0
        decode_ok = plain and backend.name == "triton_paged" and kv_cache is None
        met = (decode_ok, plain)  # each kind's needs, in GRAPHS_OF_MODE's order
        if not capture:  # and "auto", which picks by device, is no mode to run uncaptured
            if requested == "auto" or any(want == "must" and not ok for want, ok in zip(wants, met, strict=True)):
                raise ValueError(f"static graph buffers (capture_graphs=False) for cuda_graphs={requested!r} need "
                                 "cuda_graphs='decode' or 'piecewise', no tensor parallelism, pipeline stage or "
                                 "mixture of experts, and for decode graphs the triton_paged backend and a KV cache "
                                 "of the runner's own")  # fmt: skip
        elif self.device.type != "cuda":
            return False, False
        decode, pieces = (bool(want) and ok for want, ok in zip(wants, met, strict=True))
        return decode, pieces

    def tokens_of(self, slot: int) -> list[int]:
        """Every token the slot holds (prompt, outputs and sampled tokens)."""
        return self.batch.tokens_of(slot)

    def apply_plan_deltas(self, plan: _core.StepPlan) -> None:
        # Order matters: trims belong to a slot's old occupant; a finished slot may be reused by a new request.
        trim_slots = np.asarray(plan.trim_slots, np.int64).reshape(-1)
        if len(trim_slots):
            self.batch.trim_blocks(trim_slots, np.asarray(plan.trim_num_blocks, np.int64).reshape(-1))
        self.batch.remove(np.asarray(plan.finished_slots, np.int64).reshape(-1))
        for req in plan.new_requests:
            self.batch.add(req)
        for append in plan.block_appends:
            self.batch.append_blocks(int(append.slot), append.block_ids)

    def execute(self, plan: _core.StepPlan) -> StepOutput:
        self.apply_plan_deltas(plan)
        if self.kv_pulls:
            pulls, self.kv_pulls = self.kv_pulls, []
            run_kv_pulls(pulls, self.kv_connector, self.batch, self.model, self.device)
        slots = np.asarray(plan.sched_slots, np.int64).reshape(-1)
        if not len(slots):
            return StepOutput.empty(plan.step_id)
        lookahead = np.asarray(plan.sched_lookahead, np.int64).reshape(-1)
        if self.proposer is not None and len(lookahead) and lookahead.any():
            step = SpeculativeStep(self.model, self.batch, self.sampler, self.proposer, self.kv_cache)
            return step.execute(plan, slots, lookahead)
        starts = np.asarray(plan.sched_start, np.int64).reshape(-1)
        lens = np.asarray(plan.sched_len, np.int64).reshape(-1)
        sample = np.asarray(plan.sched_sample, np.bool_).reshape(-1)
        if self.pipeline is not None:
            return self._execute_stage(self.pipeline, plan.step_id, slots, starts, lens, sample)
        graphs = self.graphs
        if graphs is not None and self.proposer is None and len(slots) <= graphs.max_batch and (lens == 1).all():
            with torch.inference_mode():
                logits = graphs.run(*self.batch.decode_arrays(slots, starts))
                if not sample.all():
                    logits = logits[torch.from_numpy(np.flatnonzero(sample)).to(logits.device)]
            sampled_slots = slots[sample]
        else:
            step = self.batch.prepare(slots, starts, lens, sample)
            pieces = self.pieces if self.proposer is None else None
            with torch.inference_mode(), attention_metadata_scope(step.metadata):
                # The sampler widens to float32 itself where it needs to (exactly), so plain steps skip that copy.
                if pieces is not None and len(step.input_ids) <= pieces.max_tokens:
                    logits = self.model.logits(pieces.run(step.input_ids, step.positions), float_logits=False)
                else:
                    logits = self.model(step.input_ids, step.positions, float_logits=False)
            if self.proposer is not None:
                self.proposer.observe_step(step.input_ids, step.positions, step.metadata)
            sampled_slots = step.sampled_slots
        if not len(sampled_slots):
            return StepOutput.empty(plan.step_id)
        return self._sample(plan.step_id, logits, sampled_slots)

    def _execute_stage(
        self, pipeline: SampledTokens, step_id: int, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray,
        sample: np.ndarray,
    ) -> StepOutput:
        """A pipeline stage's part of a step, in micro-batches: while the next stage computes one, this stage
        computes the next. The last stage samples every row at once (as one rank would) and shares the tokens; an
        earlier stage appends them to its batch and reports nothing (the result rank does)."""
        last = pipeline.stage.is_last
        logits = []
        for part in split_micro_batches(lens, pipeline.stage.num_stages):
            step = self.batch.prepare(slots[part], starts[part], lens[part], sample[part])
            with torch.inference_mode(), attention_metadata_scope(step.metadata):
                if last:
                    logits.append(self.model(step.input_ids, step.positions, float_logits=False))
                else:
                    self.model.model(step.input_ids, step.positions)  # the hidden states go to the next stage
        sampled_slots = slots[sample]
        if not len(sampled_slots):
            return StepOutput.empty(step_id)
        if not last:
            self.batch.append_sampled(sampled_slots, pipeline.share(np.zeros(len(sampled_slots), np.int64)))
            return StepOutput.empty(step_id)
        out = self._sample(step_id, torch.cat(logits), sampled_slots)
        pipeline.share(out.token_ids)
        return out

    def _sample(self, step_id: int, logits: torch.Tensor, sampled_slots: np.ndarray) -> StepOutput:
        """One token for each sampled slot (row i of the logits is sampled_slots[i]'s), appended to its tokens."""
        if self.batch.plain_greedy(sampled_slots):
            out = self.sampler.greedy(logits)
        else:
            out = self.sampler.sample(logits, self.batch.sampling_batch(sampled_slots))
        tokens = out.token_ids.cpu().numpy()
        self.batch.append_sampled(sampled_slots, tokens)
        return StepOutput(
            step_id,
            sampled_slots.astype(np.int32),
            tokens.astype(np.int32),
            out.logprobs.cpu().numpy().astype(np.float32),
            None if out.top_token_ids is None else out.top_token_ids.cpu().numpy().astype(np.int32),
            None if out.top_logprobs is None else out.top_logprobs.float().cpu().numpy(),
        )

    def compute_prompt_kv(self, slot: int) -> None:
        """Local-prefill fallback: writes the KV of the slot's prompt into its blocks (no sampling)."""
        compute_prompt_kv(self.batch, self.model, slot)
