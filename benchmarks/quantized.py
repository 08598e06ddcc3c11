"""Quantized GGUF weights (--quantization gguf) against the dequantized float path, same process, alternating rounds.
Last line: one JSON object.

    python benchmarks/quantized.py [--model PATH] [--dtype float32] [--threads 1] [--quick]

- single_tok_s / float_single_tok_s: one request decoding alone (benchmarks/throughput.py's run_single_stream), median
  of the rounds; ratio_single = their ratio.
- prefill_1k_ms / float_prefill_1k_ms: one 1,024-token prompt prefilled in one step; ratio_prefill = float / quantized
  (above 1: the quantized path is faster).
- kernels: per projection shape of the model (fused qkv, o, gate_up, down, lm_head) and row count (1, 16, 32, 64, 256
  and the prompt's; the LM head, which sees one row per sequence, up to 256), milliseconds per call: `float_ms` the
  float path's F.linear / native kernel on float weights, `quant_ms` quant_ops.linear (the int8 kernel, with 8-row
  weight panels from 32 rows), `dequant_gemm_ms` the other route: the weight's native dequantization and the float32
  GEMM; `speedup` = float_ms / quant_ms. `dequantize_ms`: the weight's native dequantization alone.
- routes (`--routes` alone: only this): for each block format (`--formats`), on the model's projection shapes (random
  blocks) and input rows (`--rows`, default 32-1,024), `int8_ms` (quant_ops.linear) against `dequant_gemm_ms`,
  alternating rounds, best of the repeats; `int8_speedup` = dequant_gemm_ms / int8_ms; per format, `layer_m*` sums
  one layer's four projections. Where the CPU has AVX-512 VNNI (which products of 32 or more rows take with the
  weight's packed panels, as loaded models have them), also `vnni_ms` (quant_ops.linear with panels) against
  `avx2_panels_ms` (the same with avx2_only) and `vnni_speedup` = avx2_panels_ms / vnni_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ringserve.frontend.model_source import embedded_model_path
from ringserve.workers.model_runner import NewRequest, StepPlan
from throughput import run_single_stream


def prefill_ms(runner, prompt: np.ndarray, block_size: int) -> float:
    blocks = np.arange(-(-(len(prompt) + 1) // block_size), dtype=np.int32)
    one = np.zeros(1, np.int32)
    request = NewRequest(0, prompt.astype(np.int32), blocks, num_prompt_tokens=len(prompt), temperature=0.0)
    start = time.perf_counter()
    runner.execute(StepPlan(0, new_requests=[request], sched_slots=one, sched_start=one,
                            sched_len=np.array([len(prompt)], np.int32), sched_sample=np.ones(1, bool)))  # fmt: skip
    elapsed = time.perf_counter() - start
    runner.execute(StepPlan(1, finished_slots=one))
    return elapsed * 1e3


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def dequantized_product(x: torch.Tensor, weight: Any, values: torch.Tensor) -> torch.Tensor:
    """x @ W^T by the float32 GEMM on W dequantized natively into `values` (the route quant_ops does not take)."""
    from ringserve.workers.model import cpu_ops, quant_ops

    return cpu_ops.linear(x, quant_ops.dequantize(weight, out=values))


def kernel_profile(float_model, quant_model, rows: tuple[int, ...], repeats: int) -> dict[str, dict[str, float]]:
    from ringserve.workers.model import quant_ops

    layer_f, layer_q = float_model.model.layers[0], quant_model.model.layers[0]
    pairs = {
        "qkv": (layer_f.self_attn.qkv_weight, layer_q.self_attn.qkv_weight),
        "o": (layer_f.self_attn.o_proj.weight, layer_q.self_attn.o_proj.qweight),
        "gate_up": (layer_f.mlp.gate_up_weight, layer_q.mlp.gate_up_weight),
        "down": (layer_f.mlp.down_proj.weight, layer_q.mlp.down_proj.qweight),
        "lm_head": (float_model.lm_head.weight, quant_model.lm_head.qweight),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (wf, wq) in pairs.items():
        values = torch.empty(wq.shape)
        dequantize_ms = best_ms(lambda wq=wq, values=values: quant_ops.dequantize(wq, out=values), repeats)
        out[f"{name}_dequantize_ms"] = {"ms": round(dequantize_ms, 3)}
        for m in rows:
            if name == "lm_head" and m > 256:
                continue
            x = torch.randn(m, wf.shape[1], dtype=wf.dtype)
            times = {
                "float_ms": best_ms(lambda x=x, wf=wf: quant_ops.linear(x, wf), repeats),
                "quant_ms": best_ms(lambda x=x, wq=wq: quant_ops.linear(x, wq), repeats),
                "dequant_gemm_ms": best_ms(lambda x=x, wq=wq, v=values: dequantized_product(x, wq, v), repeats),
            }
            row: dict[str, float] = {key: round(value, 3) for key, value in times.items()}
            row["speedup"] = round(times["float_ms"] / times["quant_ms"], 2)
            out[f"{name}_m{m}"] = row
    return out


def random_weight(kind: int, rows: int, cols: int, rng: np.random.Generator) -> Any:
    """A QuantizedWeight of `kind` with random values and small finite scales (timing does not depend on them)."""
    from ringserve.workers.model import quant_ops

    block_bytes = quant_ops.BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // 32, block_bytes), dtype=np.uint8)
    half, single = np.float16, np.float32  # each block's leading scale (and offset) fields
    fields = {quant_ops.Q8_0: (half, 1), quant_ops.Q4_0: (half, 1), quant_ops.Q4_1: (half, 2),
              quant_ops.Q4_1F: (single, 2), quant_ops.Q8_2F: (single, 2)}  # fmt: skip
    dtype, count = fields[kind]
    header = np.frombuffer(np.full(count, 0.01, dtype).tobytes(), np.uint8)
    raw[..., : header.size] = header
    return quant_ops.QuantizedWeight(kind, torch.from_numpy(raw.reshape(rows, -1)), cols)


def route_profile(model: Any, rows: tuple[int, ...], repeats: int, formats: list[str], rounds: int) -> dict[str, Any]:
    """Both routes of every block format on the shapes of `model`'s (fast-path) layer 0 (see the module docstring)."""
    from ringserve.workers.model import cpu_ops, quant_ops

    layer = model.model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_weight.shape, "o": layer.self_attn.o_proj.weight.shape,
              "gate_up": layer.mlp.gate_up_weight.shape, "down": layer.mlp.down_proj.weight.shape}  # fmt: skip
    names = {quant_ops.Q8_0: "Q8_0", quant_ops.Q8_2F: "Q6_K", quant_ops.Q4_0: "Q4_0", quant_ops.Q4_1: "Q4_1",
             quant_ops.Q4_1F: "Q4_K"}  # fmt: skip
    rng = np.random.default_rng(0)
    vnni = bool(cpu_ops._MODULE.has_avx512_vnni_quant())
    out: dict[str, Any] = {"avx512_vnni": vnni}
    for kind, label in names.items():
        if label not in formats:
            continue
        totals = {m: [0.0, 0.0] for m in rows}
        for shape_name, (n, k) in shapes.items():
            weight = random_weight(kind, n, k, rng)
            packed = weight.with_panels() if vnni else weight
            for m in rows:
                x = torch.randn(m, k)
                values = torch.empty(n, k)
                int8 = lambda x=x, w=weight: quant_ops.linear(x, w)  # noqa: E731
                dequantized = lambda x=x, w=weight, v=values: dequantized_product(x, w, v)  # noqa: E731
                times: dict[str, list[float]] = {"int8": [], "dequant": []}
                for _ in range(rounds):  # alternating
                    times["int8"].append(best_ms(int8, repeats))
                    times["dequant"].append(best_ms(dequantized, repeats))
                int8_ms, dequant_ms = min(times["int8"]), min(times["dequant"])
                totals[m][0] += int8_ms
                totals[m][1] += dequant_ms
                out[f"{label}_{shape_name}_m{m}"] = {"int8_ms": round(int8_ms, 3),
                                                      "dequant_gemm_ms": round(dequant_ms, 3),
                                                      "int8_speedup": round(dequant_ms / int8_ms, 2)}  # fmt: skip
                if vnni and m >= 32:
                    fast = lambda x=x, w=packed: quant_ops.linear(x, w)  # noqa: E731
                    avx2 = lambda x=x, w=packed: quant_ops.linear(x, w, avx2_only=True)  # noqa: E731
                    ab: dict[str, list[float]] = {"vnni": [], "avx2": []}
                    for _ in range(rounds):  # alternating
                        ab["vnni"].append(best_ms(fast, repeats))
                        ab["avx2"].append(best_ms(avx2, repeats))
                    out[f"{label}_{shape_name}_m{m}"].update(
                        vnni_ms=round(min(ab["vnni"]), 3), avx2_panels_ms=round(min(ab["avx2"]), 3),
                        vnni_speedup=round(min(ab["avx2"]) / min(ab["vnni"]), 2))  # fmt: skip
                print(label, shape_name, m, out[f"{label}_{shape_name}_m{m}"], file=sys.stderr, flush=True)
        for m, (int8_ms, dequant_ms) in totals.items():
            out[f"{label}_layer_m{m}"] = {"int8_ms": round(int8_ms, 3), "dequant_gemm_ms": round(dequant_ms, 3),
                                          "total_speedup": round(dequant_ms / int8_ms, 2)}  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file (default: $RINGSERVE_TEST_GGUF or the embedded model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3, quick 1)")
    p.add_argument("--quick", action="store_true", help="one round, 32 decode tokens, 512-token prompt")
    p.add_argument("--routes", action="store_true", help="only the int8-or-dequantized route profile")
    p.add_argument("--formats", default="Q8_0,Q6_K,Q4_0,Q4_1,Q4_K", help="--routes: the block formats measured")
    p.add_argument("--rows", default=None, help="--routes: input row counts (default 32,64,256,512,1024)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.routes:
        from ringserve.workers.loader import load_model
        from ringserve.workers.model.fast_paths import apply_fast_paths

        model_path = Path(args.model or os.environ.get("RINGSERVE_TEST_GGUF") or embedded_model_path())
        model = apply_fast_paths(load_model(model_path, torch.float32, quantization="none"))
        rows = tuple(int(m) for m in (args.rows or ("32,64,256" if args.quick else "32,64,256,512,1024")).split(","))
        print(json.dumps({"threads": torch.get_num_threads(), "load_avg_1min": round(os.getloadavg()[0], 2),
                          "routes": route_profile(model, rows, 3 if args.quick else 5, args.formats.split(","),
                                                  args.rounds or (1 if args.quick else 3))}))  # fmt: skip
        return
    rounds = args.rounds or (1 if args.quick else 3)
    gen, prompt_len = (32, 512) if args.quick else (128, 1024)

    from ringserve.workers.loader import load_model, parse_dtype
    from ringserve.workers.model_runner import ModelRunner

    dtype = parse_dtype(args.dtype)
    model_path = Path(args.model or os.environ.get("RINGSERVE_TEST_GGUF") or embedded_model_path())
    block_size = 16
    runners = {}
    for setting in ("none", "gguf"):
        model = load_model(model_path, dtype, quantization=setting)
        runners[setting] = ModelRunner(model, block_size=block_size, num_kv_blocks=prompt_len // block_size + 16)
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, runners["none"].model.config.vocab_size, size=prompt_len)
    singles: dict[str, list[float]] = {"none": [], "gguf": []}
    prefills: dict[str, list[float]] = {"none": [], "gguf": []}
    for runner in runners.values():  # warm-up
        run_single_stream(runner, prompt[:8], 4, block_size)
    for r in range(rounds):
        for setting, runner in runners.items():
            singles[setting].append(run_single_stream(runner, prompt[:16], gen, block_size))
            prefills[setting].append(prefill_ms(runner, prompt, block_size))
        print(f"round {r}: {singles} {prefills}", file=sys.stderr)
    profile = kernel_profile(runners["none"].model, runners["gguf"].model, (1, 16, 32, 64, 256, prompt_len),
                             3 if args.quick else 5)  # fmt: skip
    single = {k: float(np.median(v)) for k, v in singles.items()}
    prefill = {k: float(np.median(v)) for k, v in prefills.items()}
    result = {
        "model": model_path.name,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "prompt_len": prompt_len,
        "single_tok_s": round(single["gguf"], 2),
        "float_single_tok_s": round(single["none"], 2),
        "ratio_single": round(single["gguf"] / single["none"], 3),
        "prefill_1k_ms" if prompt_len == 1024 else "prefill_ms": round(prefill["gguf"], 1),
        "float_prefill_1k_ms" if prompt_len == 1024 else "float_prefill_ms": round(prefill["none"], 1),
        "ratio_prefill": round(prefill["none"] / prefill["gguf"], 3),
        "kernels": profile,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
