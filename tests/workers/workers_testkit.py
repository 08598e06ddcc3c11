"""Step plans and tiny random Hugging Face models for worker tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.model import KVCache, LlamaForCausalLM
from ringserve.workers.model_runner import BlockAppend as BlockAppend
from ringserve.workers.model_runner import NewRequest as NewRequest
from ringserve.workers.model_runner import StepPlan
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers import LlamaConfig as HfLlamaConfig
from transformers import LlamaForCausalLM as HfLlamaForCausalLM


def plan(step_id: int, sched: list[tuple[int, int, int, bool]], **deltas: object) -> StepPlan:
    """sched: (slot, start, len, sample) per scheduled request."""
    cols = list(zip(*sched, strict=True)) if sched else [[], [], [], []]
    return StepPlan(
        step_id=step_id,
        sched_slots=np.asarray(cols[0], np.int32),
        sched_start=np.asarray(cols[1], np.int32),
        sched_len=np.asarray(cols[2], np.int32),
        sched_sample=np.asarray(cols[3], bool),
        **deltas,  # type: ignore[arg-type]
    )


def ids(*values: int) -> np.ndarray:
    return np.asarray(values, np.int32)


TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

VARIANTS = {
    "llama": lambda: HfLlamaForCausalLM(HfLlamaConfig(**TINY, rope_theta=10000.0)),
    "llama_tied": lambda: HfLlamaForCausalLM(HfLlamaConfig(**TINY, tie_word_embeddings=True)),
    "llama3_rope_scaling": lambda: HfLlamaForCausalLM(
        HfLlamaConfig(
            **TINY,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),
    "qwen2_attention_bias": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False)),
    # One KV head and an odd vocabulary: tensor-parallel ranks replicate the head and zero-pad the last vocab shard.
    "llama_one_kv_head": lambda: HfLlamaForCausalLM(
        HfLlamaConfig(**{**TINY, "num_key_value_heads": 1, "vocab_size": 255})
    ),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**TINY, sliding_window=None)),
    # Architectures of the registry beyond llama; windows of 8 tokens so short prompts cross them.
    "llama_yarn": lambda: HfLlamaForCausalLM(HfLlamaConfig(**TINY, rope_scaling={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64})),
    "llama_linear": lambda: HfLlamaForCausalLM(HfLlamaConfig(**TINY, rope_scaling={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama_dynamic": lambda: HfLlamaForCausalLM(HfLlamaConfig(**TINY, rope_scaling={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral_sliding_window": lambda: MistralForCausalLM(MistralConfig(**TINY, sliding_window=8)),
    "qwen2_sliding_window": lambda: Qwen2ForCausalLM(Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)),  # layer 0 global, layer 1 local
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**TINY, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    # LongRoPE with an original context of 2, so every test sequence is past it (the long factors, all positions).
    "phi3_longrope": lambda: Phi3ForCausalLM(Phi3Config(
        **TINY, pad_token_id=0, eos_token_id=2, bos_token_id=1, original_max_position_embeddings=2,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                      "long_factor": [1.0, 1.4, 2.2, 3.5, 5.0, 7.5, 11.0, 16.0]})),
    # Phi-4-mini: RoPE on the first 0.75 of each head (12 of 16 dims); then with its LongRoPE too (6 factors for the
    # 12 rotated dims), past an original context of 2 so every position takes the long ones. Untied, unlike the real
    # one: a tiny tied model echoes its last token, and transformers' min_new_tokens would mask that echo of EOS.
    "phi4_mini": lambda: Phi3ForCausalLM(Phi3Config(
        **TINY, pad_token_id=0, eos_token_id=2, bos_token_id=1, partial_rotary_factor=0.75)),
    "phi4_mini_longrope": lambda: Phi3ForCausalLM(Phi3Config(
        **TINY, pad_token_id=0, eos_token_id=2, bos_token_id=1, partial_rotary_factor=0.75,
        original_max_position_embeddings=2,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 2.6, 3.4],
                      "long_factor": [1.0, 1.7, 3.0, 5.5, 9.0, 14.0]})),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        norm_topk_prob=False)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[0])),  # layer 0 dense, layer 1 sparse
    # Every layer sparse, as llama.cpp's qwen3moe (which has no dense layers) expects.
    "qwen3_moe_all_sparse": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    # Gemma: windows of 8; small soft-caps (Gemma 2) so the tanh bends the scores; Gemma 3's global layer with linear
    # RoPE scaling and base 1e6, its local ones with base 10000; query_pre_attn_scalar unlike head_dim.
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(
        **{**TINY, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        attn_logit_softcapping=4.0, final_logit_softcapping=6.0)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}  # fmt: skip


def save_tiny_hf_model(variant: str, folder: Path, seed: int = 0, max_shard_size: str | None = None) -> torch.nn.Module:
    """Random-init tiny model saved as safetensors; returns the HF model (float32, eval) as the reference."""
    torch.manual_seed(seed)
    hf = VARIANTS[variant]().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("_proj.bias"):  # HF zero-inits biases; make them matter
                param.normal_(0.0, 0.5)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "router.weight")):
                param.normal_(0.0, 1.0)  # decisive routing: no near-tie that rounding could flip
            elif name.endswith(("norm.weight", "layernorm.weight")):  # ones at init; make them matter too
                param.uniform_(0.5, 1.5)
    if max_shard_size is None:
        hf.save_pretrained(folder)
    else:
        hf.save_pretrained(folder, max_shard_size=max_shard_size)
    return hf


def save_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json whose token i is the word `t{i}`, so a tiny random model can be served by the real frontend."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "t2", "bos_token": "t1"}')


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama Q/K rows for ggml's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_decoder_metadata(writer: Any, cfg: Any) -> None:
    """The hyperparameters llama.cpp's converter writes for every decoder (TextModel.set_gguf_parameters)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def finish_gguf(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int, use_cache: bool = True) -> list[int]:
    """transformers' own greedy continuation (its KV cache, its sliding-window cache layers); use_cache=False runs its
    whole forward over the sequence for every token instead (the model's definition, with no cache state)."""
    if not use_cache:
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
        return tokens[len(prompt) :]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def forward_packed(
    model: LlamaForCausalLM,
    chunks: list[tuple[list[int], int, list[int]]],
    block_size: int,
) -> list[torch.Tensor]:
    """One packed step. chunks: (new tokens, start position, block table). Returns each chunk's logits rows."""
    tokens = [t for chunk, _, _ in chunks for t in chunk]
    positions = [p for chunk, start, _ in chunks for p in range(start, start + len(chunk))]
    metadata = AttentionMetadata.build(
        query_lens=[len(c) for c, _, _ in chunks],
        seq_lens=[start + len(c) for c, start, _ in chunks],
        block_tables=[blocks for _, _, blocks in chunks],
        block_size=block_size,
        logits_indices=None,
    )
    with torch.inference_mode(), attention_metadata_scope(metadata):
        logits = model(torch.tensor(tokens), torch.tensor(positions))
    return list(logits.split([len(c) for c, _, _ in chunks]))


def assert_same_bits(plain_steps: list[list[torch.Tensor]], plain_cache: KVCache,
                     native_steps: list[list[torch.Tensor]], native_cache: KVCache) -> None:  # fmt: skip
    """Every step's logits (per step, per sequence) and the whole KV cache equal, bit for bit, between two paths."""
    for plain, native in zip(plain_steps, native_steps, strict=True):
        for a, b in zip(plain, native, strict=True):
            assert torch.equal(a, b)
    for a, b in zip(plain_cache.k + plain_cache.v, native_cache.k + native_cache.v, strict=True):
        assert torch.equal(a, b)


def bind_cache(model: LlamaForCausalLM, num_blocks: int, block_size: int) -> KVCache:
    cache = KVCache.allocate(model.config, num_blocks, block_size, torch.float32, "cpu")
    model.bind_kv_cache(cache, TorchSdpaBackend())
    return cache


def serve_in_process(
    runner: object,
    requests: list[dict[str, object]],
    *,
    num_blocks: int,
    block_size: int,
    num_speculative_tokens: int = 0,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    spec_max_batch: int = 0,
    spec_min_acceptance: float = 0.0,
) -> tuple[dict[int, list[int]], object]:
    """The real C++ scheduler and a ModelRunner in one process, talking through encoded records like the engine and
    a worker do. requests: AddRequest attribute dicts (request_id, prompt_token_ids, max_tokens, ...).
    Returns each request's output tokens and the scheduler's final stats."""
    from ringserve import _core
    from ringserve.workers.worker_main import encode_result

    config = _core.EngineConfig()
    config.block_size = block_size
    config.num_blocks = num_blocks
    config.max_num_seqs = max_num_seqs
    config.max_num_batched_tokens = max_num_batched_tokens
    config.num_speculative_tokens = num_speculative_tokens
    config.spec_max_batch = spec_max_batch
    config.spec_min_acceptance = spec_min_acceptance
    scheduler = _core.Scheduler(config)
    for fields in requests:
        r = _core.AddRequest()
        for name, value in fields.items():
            setattr(r, name, value)
        assert scheduler.add_request(r) is None
    tokens: dict[int, list[int]] = {int(f["request_id"]): [] for f in requests}  # type: ignore[call-overload]
    for _ in range(10_000):
        if not scheduler.has_unfinished:
            break
        plan = scheduler.schedule()
        if plan is None:
            break
        plan = _core.decode_worker_command(_core.encode_record(plan))  # exactly what a worker reads
        result = _core.decode_worker_result(encode_result(_core, runner.execute(plan)))  # type: ignore[attr-defined]
        scheduler.update(result)
        for o in scheduler.take_outputs():
            tokens[o.request_id].extend(o.new_token_ids)
        scheduler.check_invariants()
    assert not scheduler.has_unfinished
    return tokens, scheduler.stats()
