"""Converts a Llama-architecture GGUF file (the embedded SmolLM2-135M-Instruct by default) into a Hugging Face
folder for the peers that cannot read GGUF (vLLM): config.json, generation_config.json, model.safetensors (bf16,
dequantized by the repo's GGUF loader, Q and K un-permuted) and the tokenizer the repo rebuilds from the GGUF's
metadata (tokenizer.json, tokenizer_config.json with the chat template; benchmarks/random_model.py writes them).

    python benchmarks/peer_model.py OUT_DIR [--gguf PATH] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from random_model import write_tokenizer
from ringserve.formats.gguf_file import GGUFFile
from ringserve.frontend.model_source import embedded_model_path
from ringserve.workers.loader.gguf_loader import load_gguf_model, read_gguf_config
from ringserve.workers.model import LlamaForCausalLM
from safetensors.torch import save_file


def hf_config(config, dtype: torch.dtype, bos: int | None, eos: int | None) -> dict[str, object]:
    if config.rope_scaling or config.layer_windows or config.num_experts or config.qk_norm:
        raise SystemExit("only plain Llama GGUF files convert (no RoPE scaling, sliding windows, experts, qk-norm)")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(str(np.float32(config.rms_eps))),  # the file stores it as float32
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch."),
    }


def convert(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    reader = GGUFFile(str(gguf))
    arch, config = read_gguf_config(reader, str(gguf))
    if arch.model_class is not LlamaForCausalLM:
        raise SystemExit(f"{gguf}: architecture {arch.gguf_name!r} is not converted (Llama only)")
    bos, eos = (reader.fields.get(f"tokenizer.ggml.{key}_token_id") for key in ("bos", "eos"))
    bos, eos = (None if field is None else int(field.contents()) for field in (bos, eos))
    model = load_gguf_model(gguf, dtype)
    tensors = {name: param.detach().contiguous() for name, param in model.named_parameters()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    part = out / "model.safetensors.partial"
    save_file(tensors, str(part), metadata={"format": "pt"})
    config_json = hf_config(config, dtype, bos, eos)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    write_tokenizer(out, gguf)
    part.rename(out / "model.safetensors")  # last: its presence says the folder is complete
    print(f"wrote {out} ({sum(t.numel() for t in tensors.values()) / 1e6:.1f} M parameters, {dtype})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder to write")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded model")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    convert(args.gguf or embedded_model_path(), args.out, getattr(torch, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
