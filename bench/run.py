"""Benchmark kvqueue's twins against vLLM's own FreeKVCacheBlockQueue and collections.deque.

    python bench/run.py                     # the full comparison (two vLLM sdists, once)
    python bench/run.py --quick             # pure / cython / deque only, no download, < 1 min
    python bench/run.py --baseline bd0fe74  # also both twins as built from that commit
    python bench/run.py --summarize a.json  # re-tabulate a results file

Every case runs in ``--processes`` fresh processes (``worker.py``, through ``launch.py``), in
a new random case order per round; the Markdown table goes to stdout, the raw samples to a
JSON file and the ratio chart to a PNG beside it (with matplotlib). It times whatever
``kvqueue`` imports.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import baseline
import cases
import chart
import contenders
import launch
import machine
import report

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: small, no vLLM")
    parser.add_argument("--processes", type=int, help="fresh processes per case (11; quick 3)")
    parser.add_argument("--samples", type=int, help="samples per process (9; quick 5)")
    parser.add_argument("--sample-ms", type=float, help="reference time per sample (20; quick 2)")
    parser.add_argument("--contenders", help=f"comma-separated, from {','.join(contenders.ALL)}")
    parser.add_argument("--only", help="run only the cases whose key contains this text")
    parser.add_argument("--cpu", type=int, help="pin workers to this CPU (default: the last)")
    parser.add_argument("--seed", type=int, default=0, help="seed of orders and shuffles")
    parser.add_argument("--no-download", action="store_true", help="skip vLLM not cached")
    parser.add_argument("--out", type=Path, help="results JSON (default: bench/results/...)")
    parser.add_argument("--summarize", type=Path, metavar="JSON", help="re-tabulate a results file")
    parser.add_argument("--baseline", metavar="REV", help="also time the twins at git REV")
    args = parser.parse_args(argv)
    defaults = (3, 5, 2.0) if args.quick else (11, 9, 20.0)
    args.processes = args.processes or defaults[0]
    args.samples = args.samples or defaults[1]
    args.sample_ms = args.sample_ms or defaults[2]
    chosen = contenders.QUICK if args.quick else contenders.ALL
    args.contenders = args.contenders.split(",") if args.contenders else list(chosen)
    if args.baseline:
        try:
            args.baseline = baseline.resolve(args.baseline)
        except LookupError as exc:
            raise SystemExit(f"--baseline: {exc}") from exc
        # Each twin's old build just before it: the table reads old, new.
        args.contenders = [
            run
            for name in args.contenders
            for run in ((f"{name}@{args.baseline}", name) if name in contenders.TWINS else (name,))
        ]
    return args


def select_cases(args: argparse.Namespace) -> list[cases.Case]:
    selected = cases.all_cases()
    if args.quick:
        # The small pool and the 100k build keep the smoke test well under a minute.
        selected = [c for c in selected if c.pool == cases.SMALL_POOL or c.single_shot]
        selected = [c for c in selected if c.pool <= cases.LARGE_POOL]
    if args.only:
        selected = [c for c in selected if args.only in c.key]
    return selected


def load_contenders(names: list[str], download: bool) -> tuple[list[str], dict[str, str]]:
    """The usable contenders, and why each other one is left out."""
    usable, skipped = [], {}
    for name in names:
        try:
            contenders.load(name, download=download)
        except LookupError as exc:
            skipped[name] = str(exc)
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        usable.append(name)
    return usable, skipped


def bench(args: argparse.Namespace) -> dict[str, Any]:
    names, skipped = load_contenders(args.contenders, download=not (args.quick or args.no_download))
    fallback = contenders.FALLBACK_REFERENCE
    reference = contenders.REFERENCE if contenders.REFERENCE in names else fallback
    if reference not in names:
        raise SystemExit(f"no reference: neither {contenders.REFERENCE} nor {fallback} loads")
    selected = select_cases(args)
    rng = random.Random(args.seed)
    jobs = []
    for round_ in range(args.processes):
        order = list(selected)
        rng.shuffle(order)
        jobs += [
            {
                "case": case.key,
                "round": round_,
                "seed": rng.randrange(2**32),
                "contenders": names,
                "reference": reference,
                "samples": args.samples,
                "target_ns": int(args.sample_ms * 1e6),
                "cpu": args.cpu,
            }
            for case in order
        ]
    # Described first: the checkout may move on during a long run.
    described = machine.describe()
    started = time.time()
    records = launch.run(
        [sys.executable, str(HERE / "worker.py")],
        jobs,
        lambda job: f"round {job['round'] + 1} {job['case']}",
    )
    return {
        "machine": described,
        "settings": {
            "reference": reference,
            "contenders": names,
            "skipped": skipped,
            "cases": [case.key for case in selected],
            "processes": args.processes,
            "samples": args.samples,
            "sample_ms": args.sample_ms,
            "seed": args.seed,
            "quick": args.quick,
            "baseline": args.baseline,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "seconds": round(time.time() - started, 1),
        },
        "records": records,
    }


def save(results: dict[str, Any], out: Path | None) -> Path:
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        kind = "quick" if results["settings"]["quick"] else "full"
        out = RESULTS / f"{stamp}-{platform.node()}-{kind}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return out


def publish(results: dict[str, Any], path: Path) -> None:
    print(report.table(results))
    if results["settings"]["reference"] == contenders.REFERENCE:
        print()
        print(report.targets(results))
    if report.baseline_pairs(results):
        print()
        print(report.versus(results))
    print(f"\nraw samples: {path}", file=sys.stderr)
    if chart.available():
        png = path.with_suffix(".png")
        chart.draw(results, png)
        print(f"chart: {png}", file=sys.stderr)
    else:
        print(
            "chart skipped: matplotlib is missing (pip install 'kvqueue[bench]')", file=sys.stderr
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.summarize:
        publish(json.loads(args.summarize.read_text(encoding="utf-8")), args.summarize)
        return
    results = bench(args)
    publish(results, save(results, args.out))


if __name__ == "__main__":
    main()
