"""Writes a random-weight llama checkpoint (a Hugging Face folder: config.json, model.safetensors, and the embedded
SmolLM2's tokenizer and chat template) of a named shape, so a server can be measured at a size no checkpoint on this
machine has, without downloading one. benchmarks/serve.py then loads it like any model:

    python benchmarks/random_model.py /tmp/llama-1b --shape llama-3.2-1b
    python benchmarks/serve.py --model /tmp/llama-1b --dtype bfloat16 --concurrency 64

The weights are N(0, 0.02) in bfloat16 (norms 1), drawn on the GPU when there is one; the vocabulary is SmolLM2's
49,152 tokens, so prompts are real text. Output is noise: this measures speed, never quality. Last line: one JSON
object with the folder, shape, parameters and bytes written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

# hidden, intermediate, layers, heads, KV heads, head size (the vocabulary is the tokenizer's)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 64),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, 128),
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128),
    "toy": (64, 128, 2, 4, 2, 16),
}


def write_tokenizer(folder: Path, gguf: Path | None = None) -> int:
    """The tokenizer of a GGUF file (default: the embedded model's) as tokenizer.json + tokenizer_config.json;
    returns its vocabulary size."""
    from ringserve.frontend.model_source import embedded_model_path
    from ringserve.frontend.text.tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(gguf or embedded_model_path())
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "unk_token": tokenizer.unk_token,
              "pad_token": tokenizer.pad_token, "chat_template": tokenizer.chat_template_source}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tokenizer.vocab_size


def write_model(folder: Path, shape: str, seed: int = 0) -> dict[str, object]:
    hidden, intermediate, layers, heads, kv_heads, head_dim = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden), "model.norm.weight": ones(hidden)}
    for i in tqdm(range(layers), desc=f"random {shape}", unit="layer"):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(intermediate, hidden),
            p + "mlp.up_proj.weight": normal(intermediate, hidden),
            p + "mlp.down_proj.weight": normal(hidden, intermediate),
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
        }
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return {
        "folder": str(folder), "shape": shape, "parameters": sum(t.numel() for t in tensors.values()),
        "bytes": (folder / "model.safetensors").stat().st_size,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="where to write the checkpoint (created)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    summary = write_model(args.folder, args.shape, args.seed)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
