"""A chat reply ends at `<end_of_turn>` through the real server: a Gemma 3 GGUF without `tokenizer.chat_template` gets
the built-in Gemma template, whose end of turn joins the file's end-of-generation ids and reaches the engine.

The model is a tiny Gemma 3 crafted to be a bigram table: one-hot embeddings, attention and MLP outputs zero (their
projections into the residual stream are zero), and an untied LM head whose row for token b reads token a's
direction where b follows a. After the template's last "\\n" it writes "o", "k", then `<end_of_turn>`, which the
file does not list as its end of sequence (that is `<eos>`).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from ringserve.frontend.text.tokenizer import tokenizer_from_gguf
from ringserve.v1 import generation_pb2 as pb
from server_harness import start_server

CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["\n", "\u2581", "o", "k", "u", "s", "e", "r", "m", "d", "l", "h", "i"]  # the template's characters
TOKENS = CONTROL + PIECES
HIDDEN, LAYERS, HEADS, HEAD_DIM, FFN = 64, 2, 2, 16, 64
BIGRAMS = {"\n": "o", "o": "k", "k": "<end_of_turn>"}  # what greedy decoding writes after the chat prompt


def write_bigram_gemma3(path: Path) -> None:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(1)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_sliding_window(8)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(CONTROL) + [-float(i) for i in range(len(PIECES))])
    writer.add_token_types([3] * len(CONTROL) + [1] * len(PIECES))  # control, normal
    writer.add_bos_token_id(TOKENS.index("<bos>"))
    writer.add_eos_token_id(TOKENS.index("<eos>"))
    writer.add_unk_token_id(TOKENS.index("<unk>"))
    writer.add_pad_token_id(TOKENS.index("<pad>"))
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)

    def small(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(HIDDEN, np.float32)  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w: here w = 0
    writer.add_tensor("token_embd.weight", np.eye(len(TOKENS), HIDDEN, dtype=np.float32))
    head = small(len(TOKENS), HIDDEN)
    for a, b in BIGRAMS.items():
        head[TOKENS.index(b), TOKENS.index(a)] = 1.0
    writer.add_tensor("output.weight", head)
    writer.add_tensor("output_norm.weight", ones)
    for i in range(LAYERS):
        for name, tensor in {
            "attn_norm": ones, "post_attention_norm": ones, "ffn_norm": ones, "post_ffw_norm": ones,
            "attn_q_norm": np.ones(HEAD_DIM, np.float32), "attn_k_norm": np.ones(HEAD_DIM, np.float32),
            "attn_q": small(HEADS * HEAD_DIM, HIDDEN), "attn_k": small(HEAD_DIM, HIDDEN),
            "attn_v": small(HEAD_DIM, HIDDEN), "attn_output": np.zeros((HIDDEN, HEADS * HEAD_DIM), np.float32),
            "ffn_gate": small(FFN, HIDDEN), "ffn_up": small(FFN, HIDDEN),
            "ffn_down": np.zeros((HIDDEN, FFN), np.float32),
        }.items():  # fmt: skip
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_chat_reply_stops_at_end_of_turn_without_sending_it_as_text(tmp_path: Path) -> None:
    model = tmp_path / "bigram-gemma3.gguf"
    write_bigram_gemma3(model)
    tokenizer = tokenizer_from_gguf(model)
    end_of_turn = TOKENS.index("<end_of_turn>")
    assert tokenizer.chat_template_builtin == "gemma"
    assert tokenizer.eos_token_ids == [TOKENS.index("<eos>"), end_of_turn]
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    with start_server(model, tmp_path, "--worker-threads", "1", "--num-kv-blocks", "16") as server:
        stub = server.stub()
        prompt = stub.Tokenize(pb.TokenizeRequest(messages=messages), timeout=60).token_ids
        chat = list(stub.Generate(pb.GenerateRequest(
            messages=messages, sampling=pb.SamplingParams(max_tokens=16, temperature=0.0)), timeout=120))  # fmt: skip
        code = server.stop()
    assert code == 0, server.log()
    assert tokenizer.decode(list(prompt), skip_special_tokens=False) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    assert [t for r in chat for t in r.token_ids] == [TOKENS.index("o"), TOKENS.index("k"), end_of_turn]
    assert "".join(r.text for r in chat) == "ok"
    assert chat[-1].finish_reason == pb.FINISH_REASON_STOP
