"""The run to make when a GPU is lent: CUDA tests, then worker throughput and attention-kernel figures on
random-weight Llama shapes built on the GPU (no checkpoint download). Last line: one JSON object.

    python benchmarks/gpu.py            # 1B and 8B shapes, about 5 minutes on an H200
    python benchmarks/gpu.py --quick    # 1B shape only, small counts
    python benchmarks/gpu.py --dry-run  # CPU, toy shapes: checks this script before GPU time is spent on it

Sections (each is timed and guarded: a failure is recorded under "errors" and the next section still runs):
- tests: `pytest -q -k cuda` on the worker tests that hold CUDA tests, in a subprocess (the Triton kernels
  against the reference, whole tiny models on both backends).
- bandwidth: device copy bandwidth (bytes read + written / s), the denominator of the decode bound.
- per model shape (Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256, tied;
  Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, intermediate 14336, vocab 128256), bfloat16, driven through
  ModelRunner with engine-shaped step plans (as benchmarks/throughput.py does on CPU):
  offline_tok_s (N prompts x P tokens, G greedy outputs each, prefill under a 2048-token budget, then one decode
  batch) with the triton_paged backend and piecewise graphs (the default), eagerly (`_eager`) and, as the baseline
  measured in the same run, with torch_sdpa;
  mixed_step_ms: steps of D decodes beside a C-token prompt chunk (chunked prefill, as under steady arrivals) with
  piecewise graphs, decode graphs only (`_decode_graphs`) and eagerly, mixed_step_speedup_vs_eager and
  _vs_decode_graphs, and mixed_tokens_match_eager (the share of those steps' greedy tokens equal to the eager run's:
  bf16 random weights, so near ties may differ; the CUDA tests check float32);
  hf_offline_tok_s, transformers `generate` on the same prompts (one static batch, same shape and dtype, random
  weights), and offline_speedup_vs_hf; single_stream_tok_s; bandwidth_bound_tok_s = copy bandwidth / weight
  bytes one decode step streams (every weight once; an untied input embedding is only gathered, so it is left
  out) and the fraction reached.
- attention: one layer's decode (and prefill) time of the Triton paged kernels against gather + SDPA, 8B
  attention shapes, a few batch x context sizes, with the largest output difference between the two.
- host_cpu_int8: the lent machine's own CPU (a server CPU, often with AVX-512 VNNI, which the 2-core development
  machines hide), one thread: the quantized-weight products on SmolLM2-135M's projection and LM-head shapes (random
  Q4_1 and Q8_0 blocks with packed panels) at 1, 8 and 64 input rows, the fastest path (`avx512_vnni` where the
  CPU has it) against the AVX2 one in alternating rounds, `vnni_speedup` per shape and row count and for the
  shapes summed as one SmolLM2 decode step weighs them, and whether both gave the same bits (they must). Skipped
  without the built native kernels (carry ringserve/_kernels*.so).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent

# --dry-run runs the Triton kernels in Triton's CPU interpreter; the switch must be set before triton is imported.
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

if TYPE_CHECKING:  # imported at run time once the package is importable (ensure_ringserve_importable)
    from ringserve.workers.model_runner import StepPlan

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, tie_word_embeddings=False,
    ),
    # --dry-run: the same code path at a size the CPU runs in seconds.
    "toy": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
    ),
}  # fmt: skip


@dataclass
class Counts:
    num_prompts: int
    prompt_len: int
    output_len: int
    single_stream_len: int
    decode_cases: list[tuple[int, int]]  # (batch, context) for the attention decode comparison
    prefill_cases: list[tuple[int, int]]  # (new tokens, context after them)
    attention_iters: int
    test_timeout_s: int
    mixed: tuple[int, int, int] = (32, 256, 8)  # mixed steps: decodes, prompt chunk tokens, steps


FULL = Counts(256, 128, 128, 128, [(1, 1024), (1, 8192), (32, 2048), (128, 1024), (256, 2048)],
              [(2048, 2048), (512, 4096)], 20, 240)  # fmt: skip
QUICK = Counts(64, 64, 32, 32, [(1, 4096), (64, 1024)], [(1024, 1024)], 10, 180)
DRY = Counts(4, 8, 3, 3, [(2, 40)], [(12, 30)], 1, 120, mixed=(2, 8, 2))


@dataclass
class Report:
    """Everything the run measured; sections add to it, failures land in `errors` keyed by section."""

    started: float = field(default_factory=time.perf_counter)
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    budget_s: float = 330.0
    json_out: Path | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def section(self, name: str, run: Callable[[], Any]) -> Any:
        if self.elapsed() > self.budget_s:
            self.errors[name] = f"skipped: the {self.budget_s:.0f} s time budget was spent"
            progress(f"{name}: skipped (time budget)")
            return None
        progress(f"{name} ...")
        start = time.perf_counter()
        try:
            result = run()
        except Exception as exc:  # one failed section must not lose the others' figures
            self.errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
            progress(f"{name}: FAILED {self.errors[name]}\n{traceback.format_exc()}")
            result = None
        finally:
            free_device_memory()
        progress(f"{name}: done in {time.perf_counter() - start:.1f} s")
        return result


def progress(message: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ensure_ringserve_importable() -> None:
    """`ringserve.workers` from this checkout, also where it is not installed, as on a lent GPU machine: the
    checkout's root holds the package (ringserve/ links to workers/ and backend/, whose pure-Python modules need no
    build), so the root goes on sys.path, and on PYTHONPATH for the pytest subprocess."""
    try:
        import ringserve.workers  # noqa: F401

        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    progress(f"ringserve.workers imported from {ROOT}")


def cuda_test_targets() -> list[str]:
    """The test files holding CUDA tests whose imports this machine has (a GPU image may lack `gguf`)."""
    targets = ["tests/workers/test_triton_paged_attention.py", "tests/workers/test_sampler.py"]
    if importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("transformers") is not None:
        targets += ["tests/workers/test_model_runner.py", "tests/workers/test_piecewise_graphs.py"]
    else:
        progress("test_model_runner.py and test_piecewise_graphs.py left out: gguf or transformers is not installed")
    return targets


# ---- engine-shaped step plans (the attributes ModelRunner reads from `_core.StepPlan`) --------------------------


def schedule(step_id: int, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray, **deltas: Any) -> StepPlan:
    from ringserve.workers.model_runner import StepPlan

    n = len(slots)
    return StepPlan(step_id, sched_slots=slots.astype(np.int32), sched_start=starts.astype(np.int32),
                    sched_len=lens.astype(np.int32), sched_sample=np.ones(n, bool), **deltas)  # fmt: skip


def finish(step_id: int, slots: np.ndarray) -> StepPlan:
    from ringserve.workers.model_runner import StepPlan

    return StepPlan(step_id, finished_slots=slots.astype(np.int32))


def offline_tok_s(runner: Any, prompts: np.ndarray, output_len: int, budget: int = 2048) -> float:
    """Every prompt prefilled (whole prompts per step within the token budget, first token sampled), then all
    decoded together; every block a request will need is handed out up front, as a large enough pool allows."""
    from ringserve.workers.model_runner import NewRequest

    n, p = prompts.shape
    blocks_each = -(-(p + output_len) // runner.block_size)
    requests = [
        NewRequest(i, prompts[i].astype(np.int32), np.arange(i * blocks_each, (i + 1) * blocks_each,
                                                             dtype=np.int32), temperature=0.0)
        for i in range(n)
    ]
    per_step, step = max(1, budget // p), 0
    synchronize(runner.device)
    start = time.perf_counter()
    for first in range(0, n, per_step):
        batch = requests[first : first + per_step]
        slots = np.array([r.slot for r in batch])
        runner.execute(schedule(step, slots, np.zeros(len(batch)), np.full(len(batch), p), new_requests=batch))
        step += 1
    slots = np.arange(n)
    for k in range(1, output_len):
        runner.execute(schedule(step, slots, np.full(n, p + k - 1), np.ones(n)))
        step += 1
    synchronize(runner.device)  # execute() reads sampled tokens back, so this is already in sync; kept explicit
    elapsed = time.perf_counter() - start
    runner.execute(finish(step, slots))
    return n * output_len / elapsed


def single_stream_tok_s(runner: Any, prompt: np.ndarray, output_len: int) -> float:
    from ringserve.workers.model_runner import NewRequest

    blocks = np.arange(-(-(len(prompt) + output_len) // runner.block_size), dtype=np.int32)
    one = np.zeros(1)
    request = NewRequest(0, prompt.astype(np.int32), blocks, temperature=0.0)
    runner.execute(schedule(0, one, one, np.array([len(prompt)]), new_requests=[request]))
    synchronize(runner.device)
    start = time.perf_counter()
    for k in range(1, output_len):
        runner.execute(schedule(k, one, np.array([len(prompt) + k - 1]), np.ones(1)))
    synchronize(runner.device)
    elapsed = time.perf_counter() - start
    runner.execute(finish(output_len, one))
    return (output_len - 1) / elapsed


# ---- sections -------------------------------------------------------------------------------------------------


def mixed_steps(runner: Any, prompts: np.ndarray, mixed: tuple[int, int, int], rng: np.random.Generator
                ) -> tuple[float, list[int]]:
    """Milliseconds per step, and the greedy tokens, of `steps` steps in which `decodes` sequences (the first rows of
    `prompts`, prefilled first) each decode one token beside a `chunk`-token slice of one long prompt."""
    from ringserve.workers.model_runner import NewRequest, StepPlan

    decodes, chunk, steps = mixed
    p, bs = prompts.shape[1], runner.block_size
    each = -(-(p + steps + 1) // bs)
    slots = np.arange(decodes)
    requests = [NewRequest(i, prompts[i].astype(np.int32), np.arange(i * each, (i + 1) * each, dtype=np.int32),
                           temperature=0.0) for i in range(decodes)]  # fmt: skip
    runner.execute(schedule(0, slots, np.zeros(decodes), np.full(decodes, p), new_requests=requests))
    long_prompt = rng.integers(10, runner.config.vocab_size, chunk * steps).astype(np.int32)
    long_blocks = np.arange(decodes * each, decodes * each + -(-(chunk * steps) // bs), dtype=np.int32)
    long_request = NewRequest(decodes, long_prompt, long_blocks, temperature=0.0)
    tokens: list[int] = []
    synchronize(runner.device)
    start = time.perf_counter()
    for k in range(steps):
        plan = StepPlan(1 + k, sched_slots=np.append(slots, decodes).astype(np.int32),
                        sched_start=np.append(np.full(decodes, p + k), k * chunk).astype(np.int32),
                        sched_len=np.append(np.ones(decodes), chunk).astype(np.int32),
                        sched_sample=np.append(np.ones(decodes, bool), k == steps - 1),
                        new_requests=[long_request] if k == 0 else [])  # fmt: skip
        tokens += runner.execute(plan).token_ids.tolist()
    synchronize(runner.device)
    elapsed = time.perf_counter() - start
    runner.execute(finish(1 + steps, np.arange(decodes + 1)))
    return 1000 * elapsed / steps, tokens


def mixed_blocks(prompt_len: int, mixed: tuple[int, int, int], block_size: int = 16) -> int:
    decodes, chunk, steps = mixed
    return decodes * -(-(prompt_len + steps + 1) // block_size) + -(-(chunk * steps) // block_size)


def run_cuda_tests(targets: list[str], timeout_s: int) -> dict[str, Any]:
    """pytest on the CUDA tests in a subprocess; its summary line and, on failure, the tail of its output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiled kernels, not the interpreter
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda", *targets]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        tail = (out.decode(errors="replace") if isinstance(out, bytes) else out)[-3000:]
        raise RuntimeError(f"CUDA tests did not finish in {timeout_s} s: {tail}") from exc
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    result = {
        "command": " ".join(cmd[1:]),
        "returncode": done.returncode,
        "summary": lines[-1] if lines else "",
        "seconds": round(time.perf_counter() - start, 1),
    }
    if done.returncode != 0:  # 5 would mean no test matched: on a GPU that is a failure too
        result["failures"] = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:30]
        result["output_tail"] = (done.stdout[-4000:] + done.stderr[-2000:]).strip()
        progress(f"CUDA tests failed:\n{result['output_tail']}")
    return result


def copy_bandwidth_gb_s(device: torch.device, megabytes: int, repeats: int = 10) -> float:
    src = torch.ones(megabytes * (1 << 20) // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9  # read + write


def build_model(shape: str, dtype: torch.dtype, device: torch.device) -> Any:
    """Random weights created straight in `dtype` on the device: no float32 copy, no host round trip."""
    from ringserve.workers.model import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position=8192)
    default_dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def streamed_weight_bytes(model: Any) -> int:
    """Bytes one decode step must read: every weight once, except an untied input embedding (rows gathered)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight is listed once
    if not model.config.tie_word_embeddings:
        embedding = model.model.embed_tokens.weight
        total -= embedding.numel() * embedding.element_size()
    return total


def bench_model(
    shape: str, counts: Counts, device: torch.device, dtype: torch.dtype, backends: list[str], bandwidth: float | None
) -> dict[str, Any]:
    """backends[0] is measured with piecewise graphs (and decode graphs for decode-only steps: the default on CUDA)
    and eagerly (`_eager`), and its mixed steps also with decode graphs only (`_decode_graphs`); every other
    backend, the baseline, once."""
    from ringserve.workers.model_runner import ModelRunner

    figures: dict[str, Any] = {"shape": shape}
    start = time.perf_counter()
    model = build_model(shape, dtype, device)
    synchronize(device)
    figures["build_s"] = round(time.perf_counter() - start, 2)
    figures["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    figures["streamed_bytes_per_token"] = streamed_weight_bytes(model)
    c = counts
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, model.config.vocab_size, size=(c.num_prompts, c.prompt_len))
    blocks = max(c.num_prompts * -(-(c.prompt_len + c.output_len) // 16), mixed_blocks(c.prompt_len, c.mixed)) + 16
    # On a GPU the graphs are captured; the dry run takes their static buffers and cuts eagerly instead (decode
    # graphs' static buffers need the triton_paged backend).
    capture = device.type == "cuda"
    first = [(backends[0], "piecewise", ""), (backends[0], "decode", "_decode_graphs"), (backends[0], "off", "_eager")]
    if not capture and backends[0] != "triton_paged":
        first.pop(1)
    variants = first + [(b, "off", f"_{b}") for b in backends[1:]]
    mixed_tokens: dict[str, list[int]] = {}
    for backend, graphs, suffix in variants:
        runner = None
        label = backend + (suffix if backend == backends[0] else "")
        try:  # the baseline still gets measured when the first backend fails
            # ModelRunner binds its KV cache and backend to the model's layers, so the runners take turns.
            start = time.perf_counter()
            runner = ModelRunner(model, block_size=16, num_kv_blocks=blocks, device=device, attention_backend=backend,
                                 cuda_graphs=graphs, capture_graphs=capture or graphs == "off")  # fmt: skip
            synchronize(device)
            if graphs == "piecewise" and runner.pieces is not None:
                figures["graph_capture_s"] = round(time.perf_counter() - start, 2)  # decode graphs and pieces
                figures["piecewise_token_sizes"] = runner.pieces.sizes
            if runner.graphs is not None:
                figures["graph_batch_sizes"] = runner.graphs.sizes
            progress(f"{shape} [{label}]: warm-up (kernel compilation)")
            offline_tok_s(runner, prompts[:2, : min(16, c.prompt_len)], 3)  # compiles the prefill and decode kernels
            single_stream_tok_s(runner, prompts[0, : min(16, c.prompt_len)], 3)  # batch 1: the split-K decode kernel
            whole_run = suffix != "_decode_graphs"  # decode graphs alone differ from piecewise in mixed steps only
            if whole_run:
                progress(f"{shape} [{label}]: offline {c.num_prompts} x {c.prompt_len} -> {c.output_len}")
                figures[f"offline_tok_s{suffix}"] = round(offline_tok_s(runner, prompts, c.output_len), 1)
            if backend == backends[0]:
                if whole_run:
                    progress(f"{shape} [{label}]: single stream, {c.single_stream_len} tokens")
                    tok_s = single_stream_tok_s(runner, prompts[0], c.single_stream_len)
                    figures[f"single_stream_tok_s{suffix}"] = round(tok_s, 1)
                    figures["attention_backend"] = backend
                progress(f"{shape} [{label}]: mixed steps, {c.mixed[0]} decodes + a {c.mixed[1]}-token chunk")
                mixed_steps(runner, prompts, (*c.mixed[:2], 1), np.random.default_rng(2))  # warm-up: these shapes
                ms, mixed_tokens[suffix] = mixed_steps(runner, prompts, c.mixed, np.random.default_rng(1))
                figures[f"mixed_step_ms{suffix}"] = round(ms, 3)
            figures.setdefault("cuda_graphs", {})[label] = {
                "decode": runner.graphs is not None and runner.graphs.capture_graphs,
                "piecewise": runner.pieces is not None and runner.pieces.capture_graphs,
            }
        except Exception as exc:
            figures.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"[:2000]
            progress(f"{shape} [{label}]: FAILED\n{traceback.format_exc()}")
        progress(f"{shape} [{label}]: {figures}")
        del runner
        free_device_memory()
    del model  # transformers' copy of the shape takes its place
    free_device_memory()
    if importlib.util.find_spec("transformers") is not None:
        progress(f"{shape} [transformers]: generate {c.num_prompts} x {c.prompt_len} -> {c.output_len}")
        try:
            figures["hf_offline_tok_s"] = round(hf_offline_tok_s(shape, prompts, c.output_len, device, dtype), 1)
            if "offline_tok_s" in figures:
                figures["offline_speedup_vs_hf"] = round(figures["offline_tok_s"] / figures["hf_offline_tok_s"], 3)
        except Exception as exc:
            figures.setdefault("errors", {})["transformers"] = f"{type(exc).__name__}: {exc}"[:2000]
            progress(f"{shape} [transformers]: FAILED\n{traceback.format_exc()}")
        free_device_memory()
    if bandwidth:
        bound = bandwidth * 1e9 / figures["streamed_bytes_per_token"]
        figures["bandwidth_bound_tok_s"] = round(bound, 1)
        if "single_stream_tok_s" in figures:
            figures["single_stream_vs_bound"] = round(figures["single_stream_tok_s"] / bound, 3)
    ratios = [(f"offline_speedup_vs_{b}", "offline_tok_s", f"offline_tok_s_{b}") for b in backends[1:]]
    ratios += [("offline_speedup_vs_eager", "offline_tok_s", "offline_tok_s_eager"),
               ("single_stream_speedup_vs_eager", "single_stream_tok_s", "single_stream_tok_s_eager"),
               ("mixed_step_speedup_vs_eager", "mixed_step_ms_eager", "mixed_step_ms"),
               ("mixed_step_speedup_vs_decode_graphs", "mixed_step_ms_decode_graphs", "mixed_step_ms")]  # fmt: skip
    if "" in mixed_tokens and "_eager" in mixed_tokens:
        got, want = mixed_tokens[""], mixed_tokens["_eager"]
        same = sum(a == b for a, b in zip(got, want, strict=False))
        figures["mixed_tokens_match_eager"] = round(same / max(len(want), 1), 4)
    for key, measured, baseline in ratios:
        if measured in figures and baseline in figures:
            figures[key] = round(figures[measured] / figures[baseline], 3)
    return figures


def hf_offline_tok_s(
    shape: str, prompts: np.ndarray, output_len: int, device: torch.device, dtype: torch.dtype
) -> float:
    """The baseline from outside the project: transformers' `generate` over the same prompts as one static batch
    (greedy, every output `output_len` long), a random-weight LlamaForCausalLM of the same shape and dtype."""
    import transformers

    cfg = SHAPES[shape]
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_heads"],
        num_key_value_heads=cfg["num_kv_heads"], head_dim=cfg["head_dim"],
        tie_word_embeddings=cfg["tie_word_embeddings"], max_position_embeddings=8192, bos_token_id=None,
        eos_token_id=None, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    default_dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    ids = torch.from_numpy(prompts.astype(np.int64)).to(device)
    mask = torch.ones_like(ids)
    kwargs: dict[str, Any] = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids[:2, :8], attention_mask=mask[:2, :8], max_new_tokens=3, **kwargs)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        synchronize(device)
        elapsed = time.perf_counter() - start
    if out.shape != (prompts.shape[0], prompts.shape[1] + output_len):
        raise RuntimeError(f"transformers generated {tuple(out.shape)}, not {prompts.shape[0]} x {output_len} more")
    del hf, out
    return prompts.shape[0] * output_len / elapsed


def time_us(device: torch.device, run: Callable[[], Any], iters: int) -> float:
    """Median wall time of `run` in microseconds (CUDA events on a GPU)."""
    run()
    run()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1000)
        else:
            start = time.perf_counter()
            run()
            times.append((time.perf_counter() - start) * 1e6)
    return float(np.median(times))


def bench_attention(
    cases: list[tuple[int, int]], kind: str, counts: Counts, device: torch.device, dtype: torch.dtype, shape: str
) -> list[dict[str, Any]]:
    """One layer's attention, Triton paged kernels against gather + SDPA, on random paged caches.

    kind "decode": (batch, context) -> batch sequences with one new token each;
    kind "prefill": (new tokens, context) -> one sequence with that chunk (context - new tokens already cached).
    """
    from ringserve.workers.attention import AttentionMetadata
    from ringserve.workers.attention.selection import get_attention_backend

    cfg = SHAPES[shape]
    heads, kv_heads, head_dim, block_size = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], 16
    triton_backend = get_attention_backend("triton_paged", device)
    sdpa_backend = get_attention_backend("torch_sdpa", device)
    rows = []
    for a, b in cases:
        query_lens, seq_lens = ([1] * a, [b] * a) if kind == "decode" else ([a], [b])
        per_seq = -(-max(seq_lens) // block_size)
        num_blocks = per_seq * len(seq_lens) + 1
        gen = torch.Generator().manual_seed(0)
        pool = torch.randperm(num_blocks, generator=gen)  # shuffled blocks: tables are not contiguous
        tables = pool[: per_seq * len(seq_lens)].view(len(seq_lens), per_seq).tolist()
        md = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, None, device=device)
        tokens = sum(query_lens)
        q = torch.randn(tokens, heads, head_dim, device=device, dtype=dtype)
        k = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn(tokens, kv_heads, head_dim, device=device, dtype=dtype)
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        scale = head_dim**-0.5
        row: dict[str, Any] = {"batch" if kind == "decode" else "new_tokens": a, "context": b}
        outputs = {}
        for name, backend in (("triton_paged", triton_backend), ("torch_sdpa", sdpa_backend)):
            run = functools.partial(backend.forward, q, k, v, k_cache, v_cache, md, scale)
            try:  # one size failing (memory, say) keeps the other sizes' figures
                row[f"{name}_us"] = round(time_us(device, run, counts.attention_iters), 1)
                outputs[name] = run()
            except Exception as exc:
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:1000]
                progress(f"attention {kind} {a} x {b} [{name}]: FAILED\n{traceback.format_exc()}")
        if len(outputs) == 2:
            row["speedup"] = round(row["torch_sdpa_us"] / row["triton_paged_us"], 2)
            row["max_abs_diff"] = float((outputs["triton_paged"].float() - outputs["torch_sdpa"].float()).abs().max())
        if "triton_paged" in outputs:
            kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * k_cache.element_size()
            row["triton_kv_gb_s"] = round(kv_bytes / (row["triton_paged_us"] * 1e-6) / 1e9, 1)
        progress(f"attention {kind}: {row}")
        rows.append(row)
        del q, k, v, k_cache, v_cache, outputs, md
        free_device_memory()
    return rows


def host_cpu_int8(repeats: int) -> dict[str, Any]:
    """The host_cpu_int8 section (see the module docstring)."""
    from ringserve.workers.model import cpu_ops, quant_ops

    module = cpu_ops._MODULE
    if module is None or not module.has_avx2_quant():
        return {"skipped": "the native kernels are not built here, or this CPU has no AVX2"}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quantized import best_ms, random_weight  # benchmarks/quantized.py

    info = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    out: dict[str, Any] = {"cpu": cpu, "avx512_vnni": bool(module.has_avx512_vnni_quant()), "shapes": {}}
    # SmolLM2-135M: fused qkv, o, gate_up, down per layer (30 layers), the tied LM head once per step.
    shapes = {"qkv": (quant_ops.Q4_1, 960, 576, 30), "o": (quant_ops.Q4_1, 576, 576, 30),
              "gate_up": (quant_ops.Q4_1, 3072, 576, 30), "down": (quant_ops.Q4_1, 576, 1536, 30),
              "lm_head": (quant_ops.Q8_0, 49152, 576, 1)}  # fmt: skip
    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = {m: [0.0, 0.0] for m in (1, 8, 64)}
        same = True
        for name, (kind, rows, cols, count) in shapes.items():
            weight = random_weight(kind, rows, cols, rng).with_panels()
            for m in step:
                x = torch.randn(m, cols)
                same = same and torch.equal(quant_ops.linear(x, weight), quant_ops.linear(x, weight, avx2_only=True))
                times: dict[str, list[float]] = {"fastest": [], "avx2": []}
                for _ in range(3):  # alternating rounds
                    times["fastest"].append(best_ms(lambda x=x, w=weight: quant_ops.linear(x, w), repeats))
                    times["avx2"].append(best_ms(lambda x=x, w=weight: quant_ops.linear(x, w, avx2_only=True), repeats))
                fastest, avx2 = min(times["fastest"]), min(times["avx2"])
                step[m][0] += count * fastest
                step[m][1] += count * avx2
                out["shapes"][f"{name}_m{m}"] = {"fastest_ms": round(fastest, 4), "avx2_ms": round(avx2, 4),
                                                 "vnni_speedup": round(avx2 / fastest, 2)}  # fmt: skip
        out["same_bits"] = same
        out["step"] = {f"m{m}": {"fastest_ms": round(f, 2), "avx2_ms": round(a, 2), "vnni_speedup": round(a / f, 2)}
                       for m, (f, a) in step.items()}  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    progress(f"host_cpu_int8: {out['step']}")
    return out


def environment(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / (1 << 30), 1), cuda=torch.version.cuda,
        )  # fmt: skip
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 1B shape only, small counts")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy shapes, torch_sdpa + the Triton interpreter")
    p.add_argument("--skip-tests", action="store_true", help="do not run the CUDA tests first")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON line to this file")
    p.add_argument(
        "--budget-s", type=float, default=330.0, help="sections starting after this many seconds are skipped"
    )
    args = p.parse_args(argv)

    if args.dry_run:
        device, dtype, counts, shapes = torch.device("cpu"), torch.float32, DRY, ["toy"]
        test_targets = ["tests/workers/test_triton_paged_attention.py"]  # the CUDA tests there skip: a cheap check
        has_triton = importlib.util.find_spec("triton") is not None
        model_backends = ["triton_paged", "torch_sdpa"] if has_triton else ["torch_sdpa"]
    else:
        if not torch.cuda.is_available():
            print(
                "benchmarks/gpu.py needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False); "
                "run `python benchmarks/gpu.py --dry-run` to check the script on CPU",
                file=sys.stderr,
            )
            return 2
        device, dtype = torch.device("cuda", 0), torch.bfloat16
        counts = QUICK if args.quick else FULL
        shapes = ["llama-3.2-1b"] if args.quick else ["llama-3.2-1b", "llama-3.1-8b"]
        test_targets = cuda_test_targets()
        model_backends = ["triton_paged", "torch_sdpa"]
        has_triton = True

    ensure_ringserve_importable()
    report = Report(budget_s=args.budget_s, json_out=args.json_out)
    figures = report.figures
    figures.update(environment(device), dry_run=args.dry_run, quick=args.quick)
    progress(f"{figures}")
    if not args.skip_tests:
        tests = report.section("tests", lambda: run_cuda_tests(test_targets, counts.test_timeout_s))
        figures["tests"] = tests
        if tests is not None and tests["returncode"] != 0:
            report.errors["tests"] = f"pytest exited {tests['returncode']}: {tests['summary']}"
    bandwidth = report.section("bandwidth", lambda: copy_bandwidth_gb_s(device, 16 if args.dry_run else 2048))
    figures["bandwidth_gb_s"] = None if bandwidth is None else round(bandwidth, 1)
    figures["models"] = {}
    for shape in shapes:
        result = report.section(
            f"model {shape}", lambda shape=shape: bench_model(shape, counts, device, dtype, model_backends, bandwidth)
        )
        if result is not None:
            figures["models"][shape] = result
            for backend, error in result.get("errors", {}).items():
                report.errors[f"model {shape} [{backend}]"] = error
    figures["host_cpu_int8"] = report.section("host_cpu_int8", lambda: host_cpu_int8(1 if args.dry_run else 5))
    if figures["host_cpu_int8"] is not None and figures["host_cpu_int8"].get("same_bits") is False:
        report.errors["host_cpu_int8"] = "the AVX-512 VNNI and AVX2 products differ"
    kernel_shape = "toy" if args.dry_run else "llama-3.1-8b"
    figures["attention_shape"] = kernel_shape
    if args.dry_run and not has_triton:
        progress("attention: skipped, triton is not installed (the dry run has nothing to compare)")
        figures["attention_decode"] = figures["attention_prefill"] = None
        return finish_report(report)
    figures["attention_decode"] = report.section(
        "attention decode", lambda: bench_attention(counts.decode_cases, "decode", counts, device, dtype, kernel_shape)
    )
    figures["attention_prefill"] = report.section(
        "attention prefill",
        lambda: bench_attention(counts.prefill_cases, "prefill", counts, device, dtype, kernel_shape),
    )
    for kind in ("attention_decode", "attention_prefill"):
        for row in figures[kind] or []:
            for key in [k for k in row if k.endswith("_error")]:
                size = f"{row.get('batch', row.get('new_tokens'))} x {row['context']}"
                report.errors[f"{kind} {size} [{key.removesuffix('_error')}]"] = row[key]
    return finish_report(report)


def finish_report(report: Report) -> int:
    report.figures["errors"] = report.errors
    report.figures["total_s"] = round(report.elapsed(), 1)
    line = json.dumps(report.figures)
    if report.json_out is not None:
        report.json_out.write_text(line + "\n")
    print(line)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
