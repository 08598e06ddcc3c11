"""Speculative decoding on CPU with the embedded model, every figure against a baseline measured in the same run.
Last line: one JSON object.

    python benchmarks/spec_decode.py [--model PATH] [--dtype bfloat16] [--quick]

Driven through the engine's C++ scheduler (`_core.Scheduler`: lookahead reservation, budget, acceptance policy,
stop rules) and the worker's ModelRunner (proposers, verification, acceptance) in one process, every StepPlan and
StepResult encoded and decoded as on the rings; no gRPC, ring transport or process hops, so the figures are the
engine's and the worker's own (as in benchmarks/throughput.py).
- single_tok_s_*: one greedy request on an input-copying chat prompt (rewrite the code given in the prompt);
  decode tokens / decode time (after its first token). base = no speculation; ngram = prompt lookup;
  selfdraft = the model's first --self-draft-layers layers + LM head, a chain of --self-draft-tokens; tree = n-gram
  lookup proposing a --tree WxD tree of depth --num-speculative-tokens (the continuations of several earlier matches
  laid onto the tree), verified in one pass with a tree attention mask; tree_selfdraft = the self-draft proposing
  a WxD tree (top-W candidates at the first D positions, then greedy chains) of depth --self-draft-tokens.
- mean_accepted: tokens per verification step (1 + accepted drafts per step that verified drafts), per proposer.
- throughput_ratio_64: 64 concurrent requests (8 random tokens + the prompt's first --concurrent-prompt-len), generated
  tokens / wall time (prefill included) with n-gram speculation on (the default policy: no lookahead while more than
  --spec-max-batch requests run) over the same with speculation off (the mean of a run before and one after).
- every speculative run's tokens are checked equal to the non-speculative run's (greedy is lossless).
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
from ringserve import _core
from ringserve.frontend.model_source import embedded_model_path

CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            result.append(running / window)
    return result
'''
PROMPT = ("Rewrite this Python function exactly, but rename the variable `running` to `total`. Reply with the code "
          f"only.\n\n```python\n{CODE}```")  # fmt: skip


def serve(runner: Any, requests: list[list[int]], max_tokens: int, k: int, spec_max_batch: int,
          num_blocks: int, block_size: int) -> dict[str, Any]:  # fmt: skip
    from ringserve.workers.worker_main import encode_result

    config = _core.EngineConfig()
    config.block_size, config.num_blocks = block_size, num_blocks
    config.max_num_seqs, config.max_num_batched_tokens = 128, 2048
    config.num_speculative_tokens, config.spec_max_batch = k, spec_max_batch
    scheduler = _core.Scheduler(config)
    for i, prompt in enumerate(requests):
        r = _core.AddRequest()
        r.request_id, r.prompt_token_ids, r.max_tokens, r.temperature, r.ignore_eos = i, prompt, max_tokens, 0.0, True
        assert scheduler.add_request(r) is None
    tokens: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    start = time.perf_counter()
    first_token_at = 0.0
    while scheduler.has_unfinished:
        plan = _core.decode_worker_command(_core.encode_record(scheduler.schedule()))
        scheduler.update(_core.decode_worker_result(encode_result(_core, runner.execute(plan))))
        for o in scheduler.take_outputs():
            tokens[o.request_id].extend(o.new_token_ids)
        if not first_token_at and all(tokens.values()):
            first_token_at = time.perf_counter()
    end = time.perf_counter()
    stats = scheduler.stats()
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens": tokens,
        "tok_s": generated / (end - start),
        "decode_tok_s": (generated - len(requests)) / max(end - first_token_at, 1e-9),
        "mean_accepted": 1 + stats.spec_accepted_tokens / stats.spec_verify_rows if stats.spec_verify_rows else None,
        "acceptance": stats.spec_accepted_tokens / stats.spec_proposed_tokens if stats.spec_proposed_tokens else None,
        "steps": stats.num_steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a .gguf file or Hugging Face folder (default: $RINGSERVE_TEST_GGUF, else the embedded model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--self-draft-layers", type=int, default=8)
    p.add_argument("--self-draft-tokens", type=int, default=3)
    p.add_argument("--tree", default="2x2", help="the tree run's shape, WxD")
    p.add_argument("--single-len", type=int, default=128, help="tokens the single stream generates")
    p.add_argument("--concurrent", type=int, default=64)
    p.add_argument("--concurrent-len", type=int, default=32)
    p.add_argument("--concurrent-prompt-len", type=int, default=64, help="leading tokens of the copying prompt")
    p.add_argument("--spec-max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="shorter generations; well under a minute")
    args = p.parse_args()
    if args.quick:
        args.single_len, args.concurrent_len, args.concurrent_prompt_len = 32, 8, 24
    if args.threads:
        torch.set_num_threads(args.threads)

    from ringserve.frontend.text.tokenizer import load_tokenizer, tokenizer_from_gguf
    from ringserve.workers.loader import load_model, parse_dtype
    from ringserve.workers.model_runner import ModelRunner
    from ringserve.workers.speculative import DraftTree, make_proposer

    model_path = Path(args.model or os.environ.get("RINGSERVE_TEST_GGUF") or embedded_model_path())
    tokenizer = tokenizer_from_gguf(model_path) if model_path.suffix == ".gguf" else load_tokenizer(model_path)
    prompt = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    t0 = time.perf_counter()
    model = load_model(model_path, parse_dtype(args.dtype))
    load_s = time.perf_counter() - t0
    block_size, num_blocks = 16, 1024

    def runner(draft: str | None, tree: DraftTree | None = None) -> Any:
        r = ModelRunner(model, block_size=block_size, num_kv_blocks=num_blocks)  # fresh KV cache and batch
        if draft is not None:
            r.proposer = make_proposer(draft, r.model, num_blocks, block_size, torch.Generator(), tree=tree)
        return r

    def single(draft: str | None, k: int, tree: DraftTree | None = None) -> dict[str, Any]:
        slots = tree.num_nodes if tree is not None else k  # a tree takes one lookahead slot per node
        return serve(runner(draft, tree), [prompt], args.single_len, slots, args.spec_max_batch, num_blocks, block_size)

    serve(runner(None), [prompt], 4, 0, 0, num_blocks, block_size)  # warm-up: allocator, kernels, rope tables
    base = single(None, 0)
    ngram = single("ngram", args.num_speculative_tokens)
    selfdraft = single(f"layers:{args.self_draft_layers}", args.self_draft_tokens)
    ngram_shape = DraftTree.parse(args.tree, args.num_speculative_tokens)
    tree = single("ngram", args.num_speculative_tokens, ngram_shape)
    shape = DraftTree.parse(args.tree, args.self_draft_tokens)
    tree_self = single(f"layers:{args.self_draft_layers}", args.self_draft_tokens, shape)
    rng = np.random.default_rng(0)
    # 64 different requests: the copying prompt with a different short random prefix each (no shared prefix blocks).
    head = prompt[: args.concurrent_prompt_len]
    batch = [rng.integers(1000, 20000, size=8).tolist() + head for _ in range(args.concurrent)]
    plain64 = serve(runner(None), batch, args.concurrent_len, 0, args.spec_max_batch, num_blocks, block_size)
    spec64 = serve(runner("ngram"), batch, args.concurrent_len, args.num_speculative_tokens, args.spec_max_batch,
                   num_blocks, block_size)  # fmt: skip
    # The baseline again after the speculative run: its mean cancels drift in the machine's speed between runs.
    plain64_after = serve(runner(None), batch, args.concurrent_len, 0, args.spec_max_batch, num_blocks, block_size)
    base64_tok_s = (plain64["tok_s"] + plain64_after["tok_s"]) / 2
    lossless = {
        "ngram": ngram["tokens"] == base["tokens"],
        "selfdraft": selfdraft["tokens"] == base["tokens"],
        "tree": tree["tokens"] == base["tokens"],
        "tree_selfdraft": tree_self["tokens"] == base["tokens"],
        "concurrent_ngram": spec64["tokens"] == plain64["tokens"] == plain64_after["tokens"],
    }
    result = {
        "model": model_path.name,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "load_s": round(load_s, 2),
        "prompt_tokens": len(prompt),
        "single_len": args.single_len,
        "num_speculative_tokens": args.num_speculative_tokens,
        "self_draft": f"layers:{args.self_draft_layers} k={args.self_draft_tokens}",
        "single_tok_s_base": round(base["decode_tok_s"], 2),
        "single_tok_s_ngram": round(ngram["decode_tok_s"], 2),
        "single_tok_s_selfdraft": round(selfdraft["decode_tok_s"], 2),
        "tree": f"ngram {args.tree} depth {args.num_speculative_tokens} ({ngram_shape.num_nodes} nodes)",
        "tree_selfdraft": f"layers:{args.self_draft_layers} {args.tree} depth {args.self_draft_tokens} "
                          f"({shape.num_nodes} nodes)",
        "single_tok_s_tree": round(tree["decode_tok_s"], 2),
        "single_tok_s_tree_selfdraft": round(tree_self["decode_tok_s"], 2),
        "speedup_tree": round(tree["decode_tok_s"] / base["decode_tok_s"], 3),
        "speedup_tree_selfdraft": round(tree_self["decode_tok_s"] / base["decode_tok_s"], 3),
        "speedup_ngram": round(ngram["decode_tok_s"] / base["decode_tok_s"], 3),
        "speedup_selfdraft": round(selfdraft["decode_tok_s"] / base["decode_tok_s"], 3),
        "mean_accepted": {
            "ngram": ngram["mean_accepted"] and round(ngram["mean_accepted"], 3),
            "selfdraft": selfdraft["mean_accepted"] and round(selfdraft["mean_accepted"], 3),
            "tree": tree["mean_accepted"] and round(tree["mean_accepted"], 3),
            "tree_selfdraft": tree_self["mean_accepted"] and round(tree_self["mean_accepted"], 3),
        },
        "acceptance_rate": {
            "ngram": ngram["acceptance"], "selfdraft": selfdraft["acceptance"], "tree": tree["acceptance"],
            "tree_selfdraft": tree_self["acceptance"],
        },
        "concurrent": args.concurrent,
        "throughput_tok_s_64_base": round(base64_tok_s, 2),
        "throughput_tok_s_64_ngram": round(spec64["tok_s"], 2),
        "throughput_ratio_64": round(spec64["tok_s"] / base64_tok_s, 3),
        "steps_64": {"base": plain64["steps"], "ngram": spec64["steps"]},
        "single_steps": {
            "base": base["steps"], "ngram": ngram["steps"], "selfdraft": selfdraft["steps"], "tree": tree["steps"],
            "tree_selfdraft": tree_self["steps"],
        },
        "lossless": lossless,
    }
    print(f"single stream: base {base['steps']} steps, ngram {ngram['steps']}, selfdraft {selfdraft['steps']}, "
          f"tree {tree['steps']}", file=sys.stderr)  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
