"""What Gemma 3's sliding windows cost (or save) on a long prompt: the same model and weights served with its windows
(five local layers of every six, window 512) and with every layer global, same process, alternating rounds.
Last line: one JSON object.

    python benchmarks/sliding_window_cost.py [--model PATH] [--prompt-len 2048] [--threads 1] [--quick]

- `prefill_ms` / `global_prefill_ms`: one prompt of --prompt-len tokens prefilled in one step (best of the rounds);
  `ratio_prefill` = global / windowed (above 1: the windows are cheaper).
- `decode_tok_s` / `global_decode_tok_s`: one request decoding --output-len tokens after that prompt (median of the
  rounds); `ratio_decode` = windowed / global (above 1: the windows are faster).
The model defaults to the Gemma 3 270M GGUF (`--model gemma-3-270m`), dequantized to --dtype; the global variant only
drops each layer's window (its RoPE base stays the local one), which is the attention cost the windows change.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from quantized import prefill_ms
from ringserve.workers.model_runner import ModelRunner
from throughput import run_single_stream


def set_windows(model: torch.nn.Module, windows: list[int | None]) -> None:
    for layer, window in zip(model.model.layers, windows, strict=True):
        layer.self_attn.window = window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="a 768-token prompt, 8 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.output_len, args.rounds = 768, 8, 2
    torch.set_num_threads(args.threads)
    from ringserve.frontend.model_source import GEMMA3_MODEL_NAME, gemma3_model_path
    from ringserve.workers.loader import load_model, parse_dtype

    path = gemma3_model_path() if args.model == GEMMA3_MODEL_NAME else Path(args.model)
    model = load_model(path, parse_dtype(args.dtype))
    windowed = [layer.self_attn.window for layer in model.model.layers]
    if not any(windowed):
        raise SystemExit(f"{path} has no sliding-window layers")
    block_size = 16
    blocks = -(-(args.prompt_len + args.output_len + 1) // block_size) + 1
    runner = ModelRunner(model, block_size=block_size, num_kv_blocks=blocks)
    prompt = np.random.default_rng(0).integers(10, 1000, size=args.prompt_len)
    runs: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in ("windowed", "global")}
    for _ in range(args.rounds):  # alternating, so drifting load hits both alike
        for kind, windows in (("windowed", windowed), ("global", [None] * len(windowed))):
            set_windows(runner.model, windows)
            runs[kind]["prefill"].append(prefill_ms(runner, prompt, block_size))
            runs[kind]["decode"].append(run_single_stream(runner, prompt, args.output_len, block_size))
    set_windows(runner.model, windowed)
    result = {
        "model": path.name, "dtype": args.dtype, "threads": args.threads, "prompt_len": args.prompt_len,
        "windows": sorted({w for w in windowed if w}), "local_layers": sum(1 for w in windowed if w),
        "layers": len(windowed),
        "prefill_ms": round(min(runs["windowed"]["prefill"]), 1),
        "global_prefill_ms": round(min(runs["global"]["prefill"]), 1),
        "decode_tok_s": round(statistics.median(runs["windowed"]["decode"]), 2),
        "global_decode_tok_s": round(statistics.median(runs["global"]["decode"]), 2),
    }  # fmt: skip
    result["ratio_prefill"] = round(result["global_prefill_ms"] / result["prefill_ms"], 3)
    result["ratio_decode"] = round(result["decode_tok_s"] / result["global_decode_tok_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
