"""apply_fast_paths rewires a plain model in place: same parameters, names and hooks, the plain model's numbers."""

from __future__ import annotations

import torch
from ringserve.workers.attention import AttentionMetadata, attention_metadata_scope
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.model import KVCache, LlamaConfig, LlamaForCausalLM, cpu_ops
from ringserve.workers.model.fast_paths import FusedAttention, FusedMLP, NativeRMSNorm, apply_fast_paths
from ringserve.workers.model.native_decoder import NativeDecodingLlama


def tiny(tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def prefill_logits(model: LlamaForCausalLM) -> torch.Tensor:
    model.bind_kv_cache(KVCache.allocate(model.config, 2, 16, torch.float32, "cpu"), TorchSdpaBackend())
    md = AttentionMetadata.build([6], [6], [[1]], 16, None)
    with torch.inference_mode(), attention_metadata_scope(md):
        return model(torch.tensor([3, 14, 15, 92, 65, 35]), torch.arange(6))


def test_the_fast_model_keeps_every_parameter_name_and_value_and_a_second_call_changes_nothing() -> None:
    model = tiny(tied=True)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    assert apply_fast_paths(model) is model
    layers = list(model.model.layers)
    assert apply_fast_paths(model) is model and list(model.model.layers) == layers
    assert isinstance(model, NativeDecodingLlama)
    assert isinstance(model.model.layers[0].self_attn, FusedAttention)
    assert isinstance(model.model.layers[0].mlp, FusedMLP)
    assert isinstance(model.model.norm, NativeRMSNorm) and isinstance(model.lm_head, cpu_ops.Linear)
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[name], t) for name, t in after.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_fast_model_gives_the_plain_models_logits_in_float32() -> None:
    plain = prefill_logits(tiny())
    fast = prefill_logits(apply_fast_paths(tiny()))
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_forward_hooks_added_before_the_fast_paths_still_run() -> None:
    # Tensor parallelism registers its all-reduce as a forward hook on the O and down projections at load time.
    model = tiny()
    seen: list[str] = []
    model.model.layers[0].self_attn.o_proj.register_forward_hook(lambda *_: seen.append("o_proj"))
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda *_: seen.append("down_proj"))
    apply_fast_paths(model)
    prefill_logits(model)
    assert seen == ["o_proj", "down_proj"]
