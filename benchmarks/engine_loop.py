"""The whole engine step loop with a null worker: request/step/result/event rings in shared memory, the C++ engine
loop, a C++ worker that decodes every StepPlan (its input preparation) and answers one token per sampled request,
and a frontend thread draining the event ring. Reports us per steady-state decode step (issue #3 target: under
100 us at 256 running). The baseline in the same run is the loop at 1 running request (fixed per-step cost).

    python benchmarks/engine_loop.py [--quick]

The last line of output is one JSON object: us_per_step and steps_per_s map running count -> value.
"""

from __future__ import annotations

import argparse
import json

from ringserve import _core
from ringserve.backend.process import anon_huge_pages_kb, malloc_huge_pages_requested, reexec_as_engine_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 steps per size, one round (< 60 s)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per size (default 1,000 quick, 3,000 full)")
    parser.add_argument("--no-huge-pages", action="store_true",
                        help="4 KiB-page malloc, not the engine process's huge-page malloc (for comparison)")
    args = parser.parse_args()
    reexec_as_engine_process(huge_pages=not args.no_huge_pages)  # the engine process's malloc settings
    steps = args.steps or (1000 if args.quick else 3000)
    sizes = (1, 256) if args.quick else (1, 64, 256, 1024)
    rounds = 1 if args.quick else 3
    us: dict[str, float] = {}
    for n in sizes:
        best = min(_core.bench_engine_loop(n, prompt_len=128, num_steps=steps)["us_per_step"] for _ in range(rounds))
        us[str(n)] = round(best, 2)
        print(f"running={n:5d}  {us[str(n)]:8.2f} us/step  {1e6 / best:10.0f} steps/s")
    print(json.dumps({
        "benchmark": "engine_loop",
        "malloc_huge_pages": malloc_huge_pages_requested(),
        "anon_huge_pages_kb": anon_huge_pages_kb(),
        "prompt_len": 128,
        "steps": steps,
        "us_per_step": us,
        "steps_per_s": {k: round(1e6 / v) for k, v in us.items()},
        "baseline_us_per_step_1_running": us["1"],
    }))


if __name__ == "__main__":
    main()
