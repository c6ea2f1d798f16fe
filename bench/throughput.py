"""The live engine's throughput three ways in one run: vLLM's queue, kvqueue's compiled twin, its
pure twin. Prints a table; asserts nothing about speed.

``make bench-engine`` (``BENCH_ARGS=--repeats 1``: the options below) runs it in the vLLM venv with
``vllm_tests`` on ``PYTHONPATH``, for the live engine's package ``live``. Each engine is
``vllm.LLM`` with the stub model and vLLM's own scheduler (``--plain``: no pool checks in the
step), serving ``--rounds`` rounds of ``--requests`` requests; only the rounds after the first are
timed (the first warms the engine's code paths; the start is not timed either). The three engines
run one after another, ``--repeats`` times in turn, and the table gives each one's median. The stub
model costs next to nothing, so the step is almost all vLLM's scheduling and bookkeeping: the
queue's share is as large as it can be in an engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from live import driver

#: KVQUEUE_VLLM for each contender (None: unset, vLLM's own queue).
CONTENDERS = {"vLLM's queue": None, "kvqueue cython": "cython", "kvqueue python": "python"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--requests", type=int, default=200, help="requests a round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=512, help="KV blocks in the pool")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    driver_args = (
        "--plain", "--rounds", str(args.rounds), "--requests", str(args.requests),
        "--max-tokens", str(args.max_tokens), "--blocks", str(args.blocks),
    )  # fmt: skip
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            for name, setting in CONTENDERS.items():
                print(f"[{repeat + 1}/{args.repeats}] {name} ...", end=" ", flush=True)
                run = driver.run(Path(work), setting, args=driver_args)
                if run.result["error"] is not None:
                    raise RuntimeError(f"{name}: {run.result['error']}\n{run.output[-3000:]}")
                installed = run.result["report"]["installed"]
                if installed != setting:
                    raise RuntimeError(f"{name}: the engine core has kvqueue {installed!r}")
                timed = run.result["rounds"][1:]
                seconds = sum(r["seconds"] for r in timed)
                requests = sum(r["requests"] for r in timed)
                tokens = sum(r["tokens"] for r in timed)
                measured[name].append((requests / seconds, tokens / seconds))
                print(f"{requests / seconds:,.0f} requests/s ({run.seconds:.0f} s with start-up)")
    reference = statistics.median(r for r, _ in measured["vLLM's queue"])
    print(
        f"\nlive vLLM engine, stub model: {args.rounds - 1} timed rounds x {args.requests} requests"
        f" x "
        f"{args.max_tokens} tokens, {args.blocks} blocks, prefix caching; median of {args.repeats}"
    )
    print(f"{'queue':<16} {'requests/s':>11} {'tokens/s':>10} {'vs vLLM':>8}")
    for name, values in measured.items():
        requests_s = statistics.median(r for r, _ in values)
        tokens_s = statistics.median(t for _, t in values)
        print(f"{name:<16} {requests_s:>11,.0f} {tokens_s:>10,.0f} {requests_s / reference:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
