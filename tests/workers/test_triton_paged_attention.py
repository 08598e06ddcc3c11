"""The Triton paged-attention backend computes exactly what the gather + SDPA reference computes.

Without a GPU the kernels run in Triton's interpreter (numpy on CPU tensors). Triton fixes the mode of its own
standard library (tl.max, tl.sum, tl.cdiv) when it is first imported, and transformers imports it early in any
pytest process, so the interpreter tests run in one subprocess started with TRITON_INTERPRET=1 (or in-process
when pytest itself was started that way). Shapes are tiny so the interpreter stays fast. The `cuda` tests run
the compiled kernels against the reference on a GPU and skip cleanly without one; the sm_90 compile test checks,
without a GPU, that the kernels the GPU will run compile to machine code.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ringserve.workers.attention import (
    ATTENTION_BACKENDS,
    AttentionMetadata,
    attention_metadata_scope,
)
from ringserve.workers.attention.selection import get_attention_backend
from ringserve.workers.attention.torch_sdpa import TorchSdpaBackend
from ringserve.workers.attention.triton_paged import TritonPagedBackend, decode_num_splits
from ringserve.workers.model import KVCache, LlamaConfig, LlamaForCausalLM
from ringserve.workers.model_runner import BlockAppend, ModelRunner, NewRequest, StepPlan

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # this process was started under Triton's interpreter
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
compiled_mode = pytest.mark.skipif(INTERPRETED, reason="needs triton in compiled mode (TRITON_INTERPRET unset)")
needs_cuda = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON) or INTERPRETED, reason="needs CUDA and triton")
in_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED),
    reason="runs in the TRITON_INTERPRET=1 subprocess of test_kernels_match_reference_in_the_triton_interpreter",
)

# Small tiles so the tiny contexts below still span several key tiles, query tiles and splits.
SMALL_TILES = dict(block_m=16, block_n=16, decode_block_n=16)


@dataclass
class PagedStep:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    scale: float
    window: int | None = None  # a sliding-window layer's window

    def run(self, backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output, K cache, V cache after the step); each run writes into its own copy of the caches."""
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        out = backend.forward(self.q, self.k, self.v, k_cache, v_cache, self.metadata, self.scale, self.window)
        return out, k_cache, v_cache

    def in_float32(self) -> PagedStep:
        f = {n: getattr(self, n).float() for n in ("q", "k", "v", "k_cache", "v_cache")}
        return PagedStep(**f, metadata=self.metadata, scale=self.scale, window=self.window)


def paged_step(
    chunks: list[tuple[int, int]],
    *,
    group: int = 2,
    kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> PagedStep:
    """chunks: (query tokens this step, context length after it) per sequence. Blocks come from a shuffled pool
    with spare blocks, so every block table is non-contiguous; the cache starts filled with random keys/values
    (the cached prefixes, and garbage elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-seq_len // block_size) for _, seq_len in chunks]
    num_blocks = sum(need) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]
    metadata = AttentionMetadata.build(
        [q for q, _ in chunks], [s for _, s in chunks], tables, block_size, None, device=device
    )
    tokens, heads = sum(q for q, _ in chunks), group * kv_heads

    def rand(*shape: int, as_dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(as_dtype).to(device)

    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    return PagedStep(
        q=rand(tokens, heads, head_dim, as_dtype=dtype),
        k=rand(tokens, kv_heads, head_dim, as_dtype=dtype),
        v=rand(tokens, kv_heads, head_dim, as_dtype=dtype),
        k_cache=rand(*cache_shape, as_dtype=kv_dtype or dtype),
        v_cache=rand(*cache_shape, as_dtype=kv_dtype or dtype),
        metadata=metadata,
        scale=head_dim**-0.5,
    )


def assert_matches_reference(step: PagedStep, backend, atol: float) -> None:
    got, k_cache, v_cache = step.run(backend)
    ref, ref_k_cache, ref_v_cache = step.run(TorchSdpaBackend())
    assert got.dtype == step.q.dtype and got.shape == step.q.shape
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=0)
    # This step's keys and values landed in their slots exactly as the reference wrote them.
    assert torch.equal(k_cache, ref_k_cache) and torch.equal(v_cache, ref_v_cache)


def interpreted_backend(**kwargs) -> TritonPagedBackend:
    backend = TritonPagedBackend("cpu", **kwargs)
    assert backend.interpret  # chosen from TRITON_INTERPRET, as a user would switch it on
    return backend


# ---- the interpreter against the reference, on CPU ------------------------------------------------------------


@in_interpreter
@pytest.mark.parametrize(
    ("group", "block_size", "head_dim"), [(1, 16, 64), (3, 8, 32), (4, 32, 16)], ids=["mha", "gqa3", "gqa4"]
)
def test_decode_batch_matches_reference(group, block_size, head_dim):
    step = paged_step([(1, 1), (1, 9), (1, 33), (1, 70)], group=group, block_size=block_size, head_dim=head_dim)
    assert_matches_reference(step, interpreted_backend(**SMALL_TILES, num_splits=1), atol=2e-6)


@in_interpreter
@pytest.mark.parametrize("num_splits", [None, 5], ids=["heuristic", "five"])
def test_long_contexts_split_across_programs_merge_to_the_same_result(num_splits):
    # Five splits of a 20-token context leave some splits empty; the merge must give them no weight.
    step = paged_step([(1, 20), (1, 150), (1, 97)], group=4, block_size=16)
    backend = interpreted_backend(**SMALL_TILES, num_splits=num_splits, min_split_tokens=32)
    assert_matches_reference(step, backend, atol=2e-6)


def test_split_count_fills_the_device_but_keeps_splits_long():
    assert decode_num_splits(1, 8, 4096, target_programs=264, min_split_tokens=256) == 16
    assert decode_num_splits(1, 8, 300, target_programs=264, min_split_tokens=256) == 2
    assert decode_num_splits(64, 8, 4096, target_programs=264, min_split_tokens=256) == 1
    assert decode_num_splits(0, 8, 0, target_programs=264, min_split_tokens=256) == 1


@in_interpreter
def test_fresh_prefill_matches_reference():
    step = paged_step([(5, 5), (37, 37), (16, 16)], group=2, block_size=8)
    assert_matches_reference(step, interpreted_backend(**SMALL_TILES), atol=2e-6)


@in_interpreter
def test_chunked_prefill_attends_to_its_cached_prefix():
    step = paged_step([(7, 30), (20, 52), (2, 2), (3, 17)], group=3, block_size=16)
    assert_matches_reference(step, interpreted_backend(**SMALL_TILES), atol=2e-6)


@in_interpreter
def test_mixed_batch_of_decodes_and_prefill_chunks_matches_reference():
    step = paged_step([(1, 40), (9, 9), (1, 3), (12, 44), (1, 17)], group=4, kv_heads=2, head_dim=128)
    assert_matches_reference(step, interpreted_backend(**SMALL_TILES, num_splits=2), atol=2e-6)


@in_interpreter
def test_default_tiles_cover_a_context_in_one_tile():
    step = paged_step([(1, 40), (9, 9), (12, 44)], group=4, head_dim=64)
    assert_matches_reference(step, interpreted_backend(), atol=2e-6)


@in_interpreter
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)],
    ids=["bf16", "bf16_q_f32_cache", "f16_q_bf16_cache"],
)
def test_half_precision_stays_close_to_a_float32_reference(dtype, kv_dtype):
    step = paged_step([(1, 40), (9, 9), (12, 44), (1, 5)], group=4, head_dim=64, dtype=dtype, kv_dtype=kv_dtype)
    got, k_cache, _ = step.run(interpreted_backend(**SMALL_TILES, num_splits=2))
    # The cache holds keys cast on write; the float32 reference reads that same rounded cache.
    reference = step.in_float32()
    reference.k, reference.v = step.k.to(kv_dtype).float(), step.v.to(kv_dtype).float()
    ref, ref_k_cache, _ = reference.run(TorchSdpaBackend())
    assert got.dtype == dtype and k_cache.dtype == kv_dtype
    assert torch.equal(k_cache.float(), ref_k_cache)
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=0)


@in_interpreter
@pytest.mark.parametrize("window", [1, 5, 20])
def test_sliding_window_masks_older_keys_like_the_reference(window):
    """Decodes (split and not) and chunks that start before, at and after the window's edge; the reference's window
    masking is itself checked against a dense computation in test_sliding_window_attention.py."""
    chunks = [(1, 3), (1, 40), (1, 70), (12, 12), (9, 30), (25, 50)]
    for splits in (1, 3):
        step = paged_step(chunks, block_size=8, seed=window)
        step.window = window
        assert_matches_reference(step, interpreted_backend(**SMALL_TILES, num_splits=splits), atol=2e-6)


@in_interpreter
def test_slots_outside_every_context_are_never_read():
    # NaN in any slot that no context covers (spare blocks, each last block's tail): one read of a V row there
    # would turn the output NaN even at zero weight.
    step = paged_step([(1, 21), (6, 6), (4, 13)], group=2, block_size=8)
    md = step.metadata
    clean = step.run(TorchSdpaBackend())[0]
    covered = torch.zeros(step.k_cache.shape[:2], dtype=torch.bool)
    for seq, seq_len in enumerate(md.seq_lens_cpu):
        for pos in range(seq_len):
            covered[int(md.block_tables[seq, pos // 8]), pos % 8] = True
    step.k_cache[~covered] = float("nan")
    step.v_cache[~covered] = float("nan")
    got = step.run(interpreted_backend(**SMALL_TILES, num_splits=2))[0]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, clean, atol=2e-6, rtol=0)


def tiny_llama(seed: int = 0, head_dim: int = 16, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=4 * head_dim, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=head_dim, max_position=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def new_request(slot: int, tokens: list[int], blocks: list[int]) -> NewRequest:
    """A greedy new request; its other sampling fields keep the records' defaults."""
    return NewRequest(slot, np.asarray(tokens, np.int32), np.asarray(blocks, np.int32), temperature=0.0)


def step_plan(step_id: int, sched: list[tuple[int, int, int, bool]], **deltas: Any) -> StepPlan:
    """sched: (slot, start, len, sample) per scheduled request; deltas: new_requests, block_appends."""
    cols = list(zip(*sched, strict=True)) if sched else [[], [], [], []]
    return StepPlan(
        step_id=step_id, new_requests=deltas.get("new_requests", []), block_appends=deltas.get("block_appends", []),
        sched_slots=np.asarray(cols[0], np.int32), sched_start=np.asarray(cols[1], np.int32),
        sched_len=np.asarray(cols[2], np.int32), sched_sample=np.asarray(cols[3], bool),
    )  # fmt: skip


def greedy_tokens(runner: ModelRunner, steps: int = 4) -> dict[int, list[int]]:
    """Two requests: one prefilled in two chunks (a block appended between them), one whole; then decodes."""
    long_prompt, short_prompt = list(range(3, 23)), [7, 1, 90, 4, 5]
    requests = [new_request(0, long_prompt, [5, 2]), new_request(1, short_prompt, [9])]
    first = runner.execute(step_plan(0, [(0, 0, 12, False), (1, 0, 5, True)], new_requests=requests))
    got = {1: [int(first.token_ids[0])]}
    second = runner.execute(step_plan(1, [(0, 12, 8, True)], block_appends=[BlockAppend(0, np.asarray([0], np.int32))]))
    got[0] = [int(second.token_ids[0])]
    for k in range(steps):
        appends = [BlockAppend(1, np.asarray([11], np.int32))] if len(short_prompt) + k == 8 else []
        out = runner.execute(step_plan(2 + k, [(0, 20 + k, 1, True), (1, 5 + k, 1, True)], block_appends=appends))
        got[0].append(int(out.token_ids[0]))
        got[1].append(int(out.token_ids[1]))
    return got


@in_interpreter
def test_tiny_llama_generates_the_same_tokens_with_either_backend():
    model = tiny_llama()
    reference = greedy_tokens(ModelRunner(copy.deepcopy(model), block_size=8, num_kv_blocks=16))
    triton_runner = ModelRunner(model, block_size=8, num_kv_blocks=16, attention_backend="triton_paged")
    assert type(triton_runner.model.model.layers[0].self_attn.backend) is TritonPagedBackend
    assert greedy_tokens(triton_runner) == reference


# ---- decode graphs' static buffers (workers/cuda_graphs.py), run eagerly: padding rows, scratch block --------


def sampled_request(slot: int, tokens: list[int], blocks: list[int], seed: int | None) -> NewRequest:
    """A request that samples (temperature 0.8, top-k 20) with a seed, or greedily without one."""
    request = new_request(slot, tokens, blocks)
    if seed is not None:
        sampling = request.sampling
        sampling.temperature, sampling.top_k, sampling.seed, sampling.has_seed = 0.8, 20, seed, True
    return request


def graph_scenario(runner: ModelRunner, device: str = "cpu", rounds: int = 3) -> dict[int, list[int]]:
    """Three requests (two seeded samplers, one greedy) prefilled together, then decode steps of 3, 2 and 1 rows
    (padded to 4, 2 and 1), one step with a row that is scheduled but not sampled, then a finish."""
    prompts = {0: [3, 9, 27, 81, 4], 1: list(range(40, 57)), 2: [7, 7, 1]}
    tables = {0: [2, 5], 1: [0, 3, 4], 2: [1]}
    seeds = {0: 11, 1: None, 2: 5}
    requests = [sampled_request(s, prompts[s], tables[s], seeds[s]) for s in (0, 1, 2)]
    first = runner.execute(step_plan(0, [(s, 0, len(prompts[s]), True) for s in (0, 1, 2)], new_requests=requests))
    got = {int(s): [int(t)] for s, t in zip(first.slots, first.token_ids, strict=True)}
    step = 1
    for live in ([0, 1, 2], [0, 2], [2]):
        for r in range(rounds):
            sched = [(s, len(prompts[s]) + len(got[s]) - 1, 1, True) for s in live]
            appends = [BlockAppend(2, np.asarray([6], np.int32))] if live == [0, 2] and r == 0 else []
            out = runner.execute(step_plan(step, sched, block_appends=appends))
            for s, t in zip(out.slots, out.token_ids, strict=True):
                got[int(s)].append(int(t))
            step += 1
    # Slot 0 decodes one more token's KV without sampling (a decode row with sample=False).
    out = runner.execute(
        step_plan(
            step, [(0, len(prompts[0]) + len(got[0]) - 1, 1, False), (2, len(prompts[2]) + len(got[2]) - 1, 1, True)]
        )
    )
    assert [int(s) for s in out.slots] == [2]
    got[2].append(int(out.token_ids[0]))
    return got


@in_interpreter
def test_static_decode_buffers_give_the_eager_tokens_and_write_only_the_scratch_block():
    model = tiny_llama()
    kwargs = dict(block_size=8, num_kv_blocks=8, attention_backend="triton_paged")
    eager = ModelRunner(copy.deepcopy(model), cuda_graphs="off", **kwargs)
    static = ModelRunner(model, cuda_graphs="decode", capture_graphs=False, max_graph_batch=16, **kwargs)
    assert static.graphs is not None and static.graphs.sizes == [1, 2, 4, 8, 16] and static.graphs.scratch_block == 8
    assert static.kv_cache.num_blocks == 9 and static.num_kv_blocks == 8  # the engine still sees 8
    want = graph_scenario(eager)
    assert graph_scenario(static) == want
    # Padding rows wrote into the scratch block, and nowhere else no request owns (block 7).
    assert static.kv_cache.k[0][8].abs().sum() > 0
    assert static.kv_cache.k[0][7].abs().sum() == 0 and static.kv_cache.v[1][7].abs().sum() == 0
    for layer in range(2):  # every block a request owns holds the same keys and values, to rounding (a padded
        # batch multiplies its rows by other kernels than an unpadded one)
        torch.testing.assert_close(static.kv_cache.k[layer][:7], eager.kv_cache.k[layer][:7])
        torch.testing.assert_close(static.kv_cache.v[layer][:7], eager.kv_cache.v[layer][:7])


def test_graph_sizes_and_where_graphs_apply():
    from ringserve.workers.cuda_graphs import graph_batch_sizes

    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    with pytest.raises(ValueError, match="max_batch"):
        graph_batch_sizes(0)
    model = tiny_llama()
    # "auto" on CPU is eager: no graphs, no scratch block.
    runner = ModelRunner(copy.deepcopy(model), block_size=8, num_kv_blocks=8, attention_backend="torch_sdpa")
    assert runner.graphs is None and runner.pieces is None and runner.kv_cache.num_blocks == 8
    with pytest.raises(ValueError, match="triton_paged"):
        ModelRunner(copy.deepcopy(model), block_size=8, num_kv_blocks=8, attention_backend="torch_sdpa",
                    cuda_graphs="decode", capture_graphs=False)  # fmt: skip
    with pytest.raises(ValueError, match="cuda_graphs='always'"):
        ModelRunner(copy.deepcopy(model), block_size=8, num_kv_blocks=8, cuda_graphs="always")  # type: ignore[arg-type]


# ---- choosing the backend -------------------------------------------------------------------------------------


def test_auto_keeps_cpu_on_torch_sdpa(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter is for tests; auto never picks it
    assert get_attention_backend("auto", "cpu").name == "torch_sdpa"
    assert get_attention_backend("torch_sdpa", "cpu").name == "torch_sdpa"


@needs_triton
def test_triton_paged_on_cpu_without_the_interpreter_says_what_to_use(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="torch_sdpa"):
        get_attention_backend("triton_paged", "cpu")


def test_unknown_backend_names_the_available_ones():
    assert ATTENTION_BACKENDS == ("auto", "torch_sdpa", "triton_paged")
    with pytest.raises(ValueError, match="auto, torch_sdpa, triton_paged"):
        get_attention_backend("flash", "cpu")


def test_serve_flags_carry_the_backend_choice_down_to_the_worker():
    pytest.importorskip("ringserve._core", reason="the engine needs the built extension")
    from ringserve.backend.engine_main import worker_command
    from ringserve.formats.engine_args import EngineArgs
    from ringserve.workers.worker_main import parse_args as worker_args

    resolved = {"model_path": "m", "dtype": "float32", "max_model_len": 64, "max_step_slowdown": "0",
                "kv_transfer": "none"}  # fmt: skip
    engine = EngineArgs(**resolved, attention_backend="triton_paged", cuda_graphs="off", max_num_seqs=48)
    command = worker_command(engine, 0, "/s", "/r")
    worker = worker_args(command[command.index("--rank") :]).engine
    assert worker.attention_backend == "triton_paged"
    assert worker.cuda_graphs == "off" and worker.max_num_seqs == 48  # graphs only as large as a step can be
    default = worker_args(worker_command(EngineArgs(**resolved), 0, "/s", "/r")[3:]).engine
    assert default.cuda_graphs == "auto" and default.max_num_seqs == 256
    with pytest.raises(SystemExit):
        worker_args(["--step-ring", "/s", "--result-ring", "/r", "--engine-args",
                     '{"model_path": "m", "attention_backend": "flash"}'])  # fmt: skip


def test_cpu_backends_need_no_triton_and_the_backend_says_how_to_get_it():
    code = (
        "import sys\n"
        "from ringserve.workers.attention.selection import get_attention_backend\n"
        "from ringserve.workers.attention.triton_paged import TritonPagedBackend\n"
        "assert get_attention_backend('auto', 'cpu').name == 'torch_sdpa'\n"
        "assert 'triton' not in sys.modules, 'choosing a CPU backend imported triton'\n"
        "sys.modules['triton'] = None  # from here on `import triton` fails, as on a machine without it\n"
        "try:\n    TritonPagedBackend('cuda')\nexcept RuntimeError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install triton" in result.stdout


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="this process already runs the interpreter tests itself")
def test_kernels_match_reference_in_the_triton_interpreter():
    tests = [
        f"{__file__}::{name}"
        for name, fn in globals().items()
        if name.startswith("test_") and in_interpreter.mark in getattr(fn, "pytestmark", [])
    ]
    assert len(tests) >= 8
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning", *tests],
        capture_output=True, text=True, env=env, timeout=600, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


# ---- the compiled kernels, without a GPU: every launch of forward() binds and compiles for sm_90 (H100/H200) ----


class FakeSm90Driver:
    """Enough of a Triton driver for `warmup` (compile, never launch) to target sm_90 on a machine with no GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


class CompileOnly:
    """Stands in for a kernel: `kernel[grid](...)` compiles with exactly the launch's arguments, runs nothing."""

    def __init__(self, jit) -> None:
        self.jit, self.compiled = jit, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.compiled.append(self.jit.warmup(*args, grid=grid, **kwargs))

        return launch


def stack_bytes(cubin: bytes) -> tuple[int, str]:
    """(bytes of stack the kernel's threads use, cuobjdump's resource line); (0, "") without the tool."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return 0, ""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True)
    line = next((x.strip() for x in usage.stdout.splitlines() if "REG:" in x), "")
    fields = dict(f.split(":", 1) for f in line.split() if ":" in f)
    return int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)), line


@needs_triton
@compiled_mode
@pytest.mark.parametrize(
    ("dtype", "head_dim"),
    [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128)],
    ids=["bf16_hd128", "f16_hd64", "f32_hd128"],
)
def test_forward_compiles_for_sm90_once_per_kernel_and_without_register_spills(monkeypatch, dtype, head_dim):
    from ringserve.workers.attention import triton_paged
    from triton.runtime.driver import driver

    monkeypatch.setattr(driver, "_active", FakeSm90Driver())
    backend = TritonPagedBackend("cpu", interpret=True)
    backend.interpret = False  # from here on it launches the compiled kernels, as on a GPU
    backend.target_programs = 2 * 132  # an H200's SMs, so long single contexts are split
    compiled = triton_paged._kernels(False)
    backend._kernels = triton_paged._Kernels(*(CompileOnly(k) for k in (compiled.decode, compiled.merge,
                                                                        compiled.prefill)))  # fmt: skip
    # Steps whose block-table widths and split counts all differ: none of that may compile another variant.
    for chunks in ([(1, 600), (20, 40)], [(1, 4000)], [(1, 40), (1, 17)], [(1, 3000), (5, 5)], [(130, 300)]):
        paged_step(chunks, group=4, kv_heads=8, head_dim=head_dim, dtype=dtype).run(backend)
    kernels = {name: getattr(backend._kernels, name).compiled for name in ("decode", "merge", "prefill")}
    assert [len(kernels[n]) for n in kernels] == [4, 3, 3]  # every launch went through the compiler
    variants = {name: {id(k): k for k in launched}.values() for name, launched in kernels.items()}
    assert [len(variants[n]) for n in kernels] == [2, 1, 1]  # decode: with and without splits
    for name, built in variants.items():
        for kernel in built:
            stack, usage = stack_bytes(kernel.asm["cubin"])
            # A few bytes parked once are harmless; too few warps for head_dim 128 spill hundreds of bytes per tile.
            assert stack <= 32, f"{name} spills registers: {usage}"


# ---- CUDA: the compiled kernels against the reference, and a whole model -------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_kernels_match_reference(dtype, head_dim):
    chunks = [(1, 1), (1, 700), (1, 2100), (300, 300), (129, 1000), (1, 33), (64, 80)]
    step = paged_step(chunks, group=4, kv_heads=8, head_dim=head_dim, dtype=dtype, device="cuda")
    backend = TritonPagedBackend("cuda")
    assert not backend.interpret
    reference = step.in_float32()
    ref = reference.run(TorchSdpaBackend())[0]
    got = step.run(backend)[0]
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    # Decodes alone, forced through the split path and through one program per context.
    decodes = paged_step([(1, 5), (1, 4000), (1, 257)], group=4, kv_heads=8, head_dim=head_dim, dtype=dtype,
                         device="cuda")  # fmt: skip
    ref = decodes.in_float32().run(TorchSdpaBackend())[0]
    for splits in (None, 1, 7):
        got = decodes.run(TritonPagedBackend("cuda", num_splits=splits))[0]
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("window", [1, 100, 4096])
def test_cuda_sliding_window_kernels_match_reference(window):
    step = paged_step([(1, 1), (1, 700), (1, 2100), (300, 300), (129, 1000), (64, 80)], group=4, kv_heads=8,
                      head_dim=64, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    step.window = window
    ref = step.in_float32().run(TorchSdpaBackend())[0]
    for splits in (None, 1, 7):
        got = step.run(TritonPagedBackend("cuda", num_splits=splits))[0]
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@needs_cuda
def test_cuda_float32_kernels_match_reference_tightly():
    step = paged_step([(1, 300), (40, 90), (17, 17)], group=3, kv_heads=2, head_dim=64, device="cuda")
    assert_matches_reference(step, TritonPagedBackend("cuda"), atol=1e-4)


@needs_cuda
def test_cuda_auto_picks_triton_paged():
    assert get_attention_backend("auto", "cuda").name == "triton_paged"


@needs_cuda
@pytest.mark.parametrize("max_position", [256, 4096], ids=["one-split", "split-k"])
def test_cuda_graphs_replay_the_eager_tokens(max_position):
    # 256 positions: one split per context in both modes. 4096: the graphs' decode kernel splits every context for
    # the longest one (eager splits for the step's), so its sums run in another order. Padded batches multiply by
    # other GEMM kernels too: tokens match, KV blocks to rounding.
    model = tiny_llama(head_dim=64, device="cuda")
    model.config.max_position = max_position
    kwargs = dict(block_size=8, num_kv_blocks=8, device="cuda", attention_backend="triton_paged")
    eager = ModelRunner(copy.deepcopy(model), cuda_graphs="off", **kwargs)
    graphs = ModelRunner(model, cuda_graphs="decode", max_graph_batch=16, **kwargs)
    assert eager.graphs is None and graphs.graphs is not None and graphs.graphs.capture_graphs
    assert sorted(graphs.graphs._graphs) == [1, 2, 4, 8, 16]
    assert graph_scenario(graphs, rounds=4) == graph_scenario(eager, rounds=4)
    torch.testing.assert_close(graphs.kv_cache.k[1][:8], eager.kv_cache.k[1][:8], atol=1e-5, rtol=1e-5)
    assert graphs.kv_cache.k[0][7].abs().sum() == 0  # no request owns block 7: only the scratch block takes padding


@needs_cuda
def test_cuda_graphs_serve_a_batch_that_grows_and_shrinks_past_sixteen():
    # 1..20 sequences decoding side by side: each step's tokens equal the eager runner's. float32, so that the
    # padded batch's other GEMM kernels change logits by rounding only, far below a greedy margin.
    model = tiny_llama(head_dim=64, device="cuda")
    kwargs = dict(block_size=16, num_kv_blocks=64, device="cuda", attention_backend="triton_paged")
    runners = [ModelRunner(copy.deepcopy(model), cuda_graphs="off", **kwargs),
               ModelRunner(model, cuda_graphs="decode", max_graph_batch=32, **kwargs)]  # fmt: skip
    outputs: list[list[list[int]]] = [[], []]
    for r, runner in enumerate(runners):
        lengths = {}
        for slot in range(20):
            prompt = [(slot * 7 + i) % 120 + 1 for i in range(3 + slot)]
            blocks = [slot * 3, slot * 3 + 1, slot * 3 + 2]
            out = runner.execute(step_plan(slot, [(slot, 0, len(prompt), True)],
                                           new_requests=[new_request(slot, prompt, blocks)]))  # fmt: skip
            lengths[slot] = len(prompt) + 1
            live = list(range(slot + 1))[-(slot % 5 + 1) * 4 :]  # 4, 8, ... up to 20 rows, then fewer
            out = runner.execute(step_plan(100 + slot, [(s, lengths[s] - 1, 1, True) for s in live]))
            outputs[r].append([int(t) for t in out.token_ids])
            for s in live:
                lengths[s] += 1
    assert outputs[1] == outputs[0]


@needs_cuda
def test_cuda_tiny_llama_generates_the_same_tokens_with_either_backend():
    model = tiny_llama(head_dim=64, device="cuda")
    kwargs = dict(block_size=16, num_kv_blocks=16, device="cuda")
    reference = greedy_tokens(ModelRunner(copy.deepcopy(model), attention_backend="torch_sdpa", **kwargs))
    assert greedy_tokens(ModelRunner(model, attention_backend="triton_paged", **kwargs)) == reference
    # bfloat16: both backends round differently, so compare the first step's logits rather than tokens.
    half = tiny_llama(head_dim=64, dtype=torch.bfloat16, device="cuda")
    metadata = AttentionMetadata.build([37], [37], [[1, 4, 2]], 16, None, device="cuda")
    logits = []
    for name in ("torch_sdpa", "triton_paged"):
        cache = KVCache.allocate(half.config, 8, 16, torch.bfloat16, "cuda")
        half.bind_kv_cache(cache, get_attention_backend(name, "cuda"))
        with torch.inference_mode(), attention_metadata_scope(metadata):
            logits.append(half(torch.arange(3, 40, device="cuda"), torch.arange(37, device="cuda")))
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2, rtol=5e-2)
