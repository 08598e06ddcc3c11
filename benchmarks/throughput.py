"""Worker throughput on CPU against Hugging Face transformers, measured in the same run. Last line: one JSON object.

    python benchmarks/throughput.py [--model PATH] [--dtype bfloat16] [--quick]

What is measured (the worker's real code path, driven directly: ModelRunner + the persistent batch + sampler, with
step plans shaped like the engine's; no gRPC, rings or engine process, so the figures are the worker's own; the
script re-executes itself with the OpenMP settings a worker process gets, backend/process.py's worker_environment):
- offline_tok_s: N prompts of P random tokens, G greedy output tokens each (EOS ignored), prefill chunked under a
  2048-token budget then decoded as one batch; generated tokens / wall time including prefill.
- single_stream_tok_s: one request decoding alone; decode tokens / decode time (median of --rounds rounds).
- hf_offline_tok_s: transformers `generate` on the same prompts as one static batch, same dtype, greedy,
  min_new_tokens = max_new_tokens = G.
- ratio_vs_hf: offline over hf_offline. Both run in --offline-rounds alternating rounds (ours, then transformers) in
  one process, both models loaded once; the figure is the median of the rounds' ratios, and offline_tok_s /
  hf_offline_tok_s are the medians of the rounds (offline_rounds_tok_s, hf_rounds_tok_s, ratio_rounds list them).
- bandwidth_gb_s: measured tensor copy bandwidth (bytes read + written / s); bandwidth_bound_tok_s: that divided
  by the weight bytes one decode step must read (every weight once; a tied embedding counts once).
- single_stream_vs_bound: single-stream tokens/s over the bound. The machine's memory bandwidth drifts by a third
  from minute to minute, so each round measures the single stream and then the copy bandwidth right after it, and
  this is the median of the rounds' ratios (bandwidth_gb_s is the median bandwidth).
- read_bandwidth_gb_s, single_stream_vs_read_bound: the same with the bytes a read-only stream (a sum over a large
  tensor) gets per second, measured in the same rounds. A copy's figure counts its writes too; on some machines a
  read-only stream reaches well below it, and this says how close decoding comes to what reading alone allows.
- contention_ratio_offline, contention_ratio_single: offline and single-stream tokens/s with one CPU-bound busy
  process (a Python busy loop) running beside the worker over the same without it, in --contention-rounds
  alternating rounds (quiet, then busy); the median of the rounds' ratios. On a machine with C cores a fair share
  is (C - 1) / C of the quiet figure when the worker's threads fill every core: 0.5 on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from ringserve.backend.process import reexec_as_worker_process
from ringserve.formats.engine_args import QUANTIZATIONS, EngineArgs, default_worker_threads
from ringserve.frontend.model_source import embedded_model_path
from ringserve.workers.model_runner import NewRequest, StepPlan
from tqdm import tqdm


def run_offline(runner, prompts: np.ndarray, gen: int, block_size: int, budget: int = 2048) -> float:
    """Engine-shaped plans: every block a request will need is given up front (the pool is large enough)."""
    n, p = prompts.shape
    blocks_each = -(-(p + gen) // block_size)
    requests = [
        NewRequest(
            i,
            prompts[i].astype(np.int32),
            np.arange(i * blocks_each, (i + 1) * blocks_each, dtype=np.int32),
            num_prompt_tokens=p,
            temperature=0.0,
        )
        for i in range(n)
    ]
    step = 0
    start = time.perf_counter()
    # Prefill: whole prompts while they fit the token budget (as the engine admits them), first token sampled.
    per_step = max(1, budget // p)
    for first in range(0, n, per_step):
        batch = requests[first : first + per_step]
        slots = np.array([r.slot for r in batch], np.int32)
        runner.execute(StepPlan(step, new_requests=batch, sched_slots=slots, sched_start=np.zeros(len(batch), np.int32),
                                sched_len=np.full(len(batch), p, np.int32), sched_sample=np.ones(len(batch), bool)))
        step += 1
    slots = np.arange(n, dtype=np.int32)
    for k in range(1, gen):
        runner.execute(StepPlan(step, sched_slots=slots, sched_start=np.full(n, p + k - 1, np.int32),
                                sched_len=np.ones(n, np.int32), sched_sample=np.ones(n, bool)))  # fmt: skip
        step += 1
    elapsed = time.perf_counter() - start
    runner.execute(StepPlan(step, finished_slots=slots))
    return n * gen / elapsed


def run_single_stream(runner, prompt: np.ndarray, gen: int, block_size: int) -> float:
    blocks = np.arange(-(-(len(prompt) + gen) // block_size), dtype=np.int32)
    one = np.zeros(1, np.int32)
    request = NewRequest(0, prompt.astype(np.int32), blocks, num_prompt_tokens=len(prompt), temperature=0.0)
    runner.execute(StepPlan(0, new_requests=[request], sched_slots=one, sched_start=one,
                            sched_len=np.array([len(prompt)], np.int32), sched_sample=np.ones(1, bool)))  # fmt: skip
    start = time.perf_counter()
    for k in range(1, gen):
        runner.execute(StepPlan(k, sched_slots=one, sched_start=np.array([len(prompt) + k - 1], np.int32),
                                sched_len=np.ones(1, np.int32), sched_sample=np.ones(1, bool)))  # fmt: skip
    elapsed = time.perf_counter() - start
    runner.execute(StepPlan(gen, finished_slots=one))
    return (gen - 1) / elapsed


def load_hf(model_path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
    return hf.eval()


def run_hf(hf: torch.nn.Module, prompts: np.ndarray, gen: int) -> float:
    ids = torch.from_numpy(prompts.astype(np.int64))
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=gen, min_new_tokens=gen, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:1, :8], attention_mask=mask[:1, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == prompts.shape[1] + gen
    return prompts.shape[0] * gen / elapsed


def _best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed call (first-touch page faults)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    src = torch.ones(megabytes * (1 << 20) // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), repeats) / 1e9  # read + write


def read_bandwidth_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes read per second by a reduction over a tensor far larger than the caches (the access a decode step's
    weight reads make; no writes)."""
    src = torch.ones(megabytes * (1 << 20) // 4)
    return src.numel() * 4 / _best_seconds(src.sum, repeats) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter (parameters() lists a tied weight once) and quantized block
    (fused views counted once); the embedding table only while it is also the LM head's float weight."""
    quantized = {m.qweight.data.untyped_storage().data_ptr(): m.qweight.data.untyped_storage().nbytes()
                 for m in model.modules() if hasattr(m, "qweight")}  # fmt: skip
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if hasattr(model.lm_head, "qweight"):
        params -= model.model.embed_tokens.weight.nbytes
    return params + sum(quantized.values())


def contention_rounds(runner, prompts: np.ndarray, args, block_size: int) -> dict[str, object]:
    """Offline and single-stream tokens/s without, then with, a busy process beside this one, per round."""
    quiet: list[tuple[float, float]] = []
    busy: list[tuple[float, float]] = []

    def measure() -> tuple[float, float]:
        offline = run_offline(runner, prompts, args.output_len, block_size)
        return offline, run_single_stream(runner, prompts[0], args.single_stream_len, block_size)

    for _ in tqdm(range(args.contention_rounds), desc="contention rounds (quiet, busy)", file=sys.stderr):
        quiet.append(measure())
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)  # let it start spinning
            busy.append(measure())
        finally:
            spinner.kill()
            spinner.wait()
    offline_ratios = [b[0] / q[0] for q, b in zip(quiet, busy, strict=True)]
    single_ratios = [b[1] / q[1] for q, b in zip(quiet, busy, strict=True)]
    return {
        "contention_ratio_offline": round(float(np.median(offline_ratios)), 3) if quiet else None,
        "contention_ratio_single": round(float(np.median(single_ratios)), 3) if quiet else None,
        "contention_quiet_tok_s": [[round(o, 2), round(s, 2)] for o, s in quiet],
        "contention_busy_tok_s": [[round(o, 2), round(s, 2)] for o, s in busy],
    }


def main() -> None:
    reexec_as_worker_process()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a .gguf file or Hugging Face folder (default: $RINGSERVE_TEST_GGUF, else the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--single-stream-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=None, help="single-stream + bandwidth rounds (default 5, quick 2)")
    p.add_argument("--offline-rounds", type=int, default=None,
                   help="offline + transformers rounds (default 3, quick 1)")
    p.add_argument("--contention-rounds", type=int, default=None,
                   help="rounds without and with a busy process beside the worker (default 3, quick 1; 0 skips them)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: what a worker picks, ringserve.formats.engine_args)")
    p.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens; finishes in well under a minute")
    p.add_argument("--quantization", default=EngineArgs().quantization, choices=QUANTIZATIONS,
                   help="GGUF weights: kept quantized (gguf), dequantized (none), or auto as the server (default)")
    p.add_argument("--skip-hf", action="store_true", help="do not run the transformers baseline")
    args = p.parse_args()
    if args.quick:
        args.num_prompts, args.output_len, args.single_stream_len = 8, 16, 16
    defaults = {"rounds": (2, 5), "offline_rounds": (1, 3), "contention_rounds": (1, 3)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.rounds < 1 or args.offline_rounds < 1 or args.contention_rounds < 0:
        p.error("--rounds and --offline-rounds must be at least 1, --contention-rounds at least 0")
    torch.set_num_threads(args.threads or default_worker_threads(len(os.sched_getaffinity(0)), 1))

    from ringserve.workers.loader import load_model, parse_dtype
    from ringserve.workers.model_runner import ModelRunner, freeze_long_lived_objects

    dtype = parse_dtype(args.dtype)
    model_path = Path(args.model or os.environ.get("RINGSERVE_TEST_GGUF") or embedded_model_path())
    t0 = time.perf_counter()
    model = load_model(model_path, dtype, quantization=args.quantization)
    load_s = time.perf_counter() - t0
    block_size = 16
    blocks = args.num_prompts * -(-(args.prompt_len + args.output_len) // block_size) + 8
    runner = ModelRunner(model, block_size=block_size, num_kv_blocks=blocks)
    freeze_long_lived_objects()  # as workers/worker_main.py does before serving
    rng = np.random.default_rng(0)
    # Ids below 10 are special tokens in most vocabularies; keep prompts to ordinary ones.
    prompts = rng.integers(10, model.config.vocab_size, size=(args.num_prompts, args.prompt_len))
    run_offline(runner, prompts[:2, :8], 2, block_size)  # warm-up (allocator, kernels)
    hf_model = None if args.skip_hf else load_hf(model_path, dtype)
    offlines, hfs = [], []
    for _ in tqdm(range(args.offline_rounds), desc="offline + transformers rounds", file=sys.stderr):
        offlines.append(run_offline(runner, prompts, args.output_len, block_size))
        if hf_model is not None:
            hfs.append(run_hf(hf_model, prompts, args.output_len))
    del hf_model
    offline = float(np.median(offlines))
    hf = float(np.median(hfs)) if hfs else float("nan")
    ratios = [o / h for o, h in zip(offlines, hfs, strict=True)] if hfs else []
    wbytes = weight_bytes(model)
    singles, bandwidths, reads = [], [], []
    for _ in tqdm(range(args.rounds), desc="single stream + bandwidth rounds", file=sys.stderr):
        singles.append(run_single_stream(runner, prompts[0], args.single_stream_len, block_size))
        bandwidths.append(copy_bandwidth_gb_s())
        reads.append(read_bandwidth_gb_s())
    single, bandwidth = float(np.median(singles)), float(np.median(bandwidths))
    vs_bound = float(np.median([s * wbytes / (b * 1e9) for s, b in zip(singles, bandwidths, strict=True)]))
    vs_read = float(np.median([s * wbytes / (b * 1e9) for s, b in zip(singles, reads, strict=True)]))
    quantized_linears = sum(hasattr(m, "qweight") for m in model.modules())
    contention = contention_rounds(runner, prompts, args, block_size)
    del runner, model
    result = {
        "model": model_path.name,
        "dtype": args.dtype,
        "quantized_linears": quantized_linears,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "load_s": round(load_s, 2),
        "offline_tok_s": round(offline, 2),
        "single_stream_tok_s": round(single, 2),
        "hf_offline_tok_s": round(hf, 2),
        "ratio_vs_hf": round(float(np.median(ratios)), 3) if ratios else None,
        "offline_rounds_tok_s": [round(v, 2) for v in offlines],
        "hf_rounds_tok_s": [round(v, 2) for v in hfs],
        "ratio_rounds": [round(v, 3) for v in ratios],
        "weight_bytes": wbytes,
        "bandwidth_gb_s": round(bandwidth, 2),
        "bandwidth_bound_tok_s": round(bandwidth * 1e9 / wbytes, 2),
        "single_stream_vs_bound": round(vs_bound, 3),
        "single_stream_rounds": [round(v, 2) for v in singles],
        "bandwidth_rounds_gb_s": [round(v, 2) for v in bandwidths],
        "read_bandwidth_gb_s": round(float(np.median(reads)), 2),
        "single_stream_vs_read_bound": round(vs_read, 3),
        **contention,
    }
    print(f"copy bandwidth {bandwidth:.2f} GB/s, weights {wbytes / 1e6:.1f} MB per decode step", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
