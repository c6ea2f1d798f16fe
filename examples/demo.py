"""What kvqueue is for, on any machine: a double free injected into a live vLLM engine on the CPU,
side by side with vLLM alone, kvqueue under ``raise``, kvqueue under ``repair``.

``python examples/demo.py [--form A|B|C|D] [--vllm 0.31.0]``, from any Python 3: it builds
or reuses the CPU vLLM venv (``vllm_tests/venv.sh``: once, several minutes; this checkout's
kvqueue is installed there), runs itself again with that venv's python (``vllm_tests`` on
``PYTHONPATH`` for the live engine's package ``live``; ``--vllm``: that release's Python code
after it, ``vllm_tests/lines.py``), then starts
``vllm.LLM`` three times with the stub model (``vllm_tests/live/``: engine core in its own
process, a KV cache on the CPU), each serving three rounds of 20 requests while one double
free is injected inside the engine core:

* ``A`` (default, vLLM issue 42571): a request's block given twice in one
  ``BlockPool.free_blocks()`` call as the request finishes;
* ``B``: a block that is already free, freed again when the next request finishes;
* ``C``: what a double free leaves in a full pool: a block a request holds, in the free list;
* ``D``: a free that releases a reference a running request still holds (every count adds up
  at the call): the holder audit finds it where the next scheduler step starts.

Each completion is compared with the stub model's own answer (``model.completion``): a block
held by two requests at once gives one of them the other's tokens, and a wrong completion.
The engine core's own checks (each block's ``ref_cnt`` against its holders, the free list
against the count) say what each queue did with the double free.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_TESTS = ROOT / "vllm_tests"
#: Set when the demo runs itself again inside the vLLM venv.
IN_VENV = "_KVQUEUE_DEMO_IN_VENV"
#: The screen: a 100-column terminal.
SCREEN = 100
LABEL = 13  # of the rows' names
WIDTH = (SCREEN - LABEL) // 3 - 2  # of a column, 2 blanks between columns
FORMS = {
    "A": "a block given twice in one BlockPool.free_blocks() call (vLLM issue 42571)",
    "B": "a block that is already free, freed again",
    "C": "a block a running request holds, linked into the free list of a full pool",
    "D": "a running request's only reference to a block, freed by another caller",
}
#: Form C needs a pool that fills up: fewer blocks than a round's peak.
BLOCKS = {"C": 96}
ROUNDS, REQUESTS, MAX_TOKENS = 3, 20, 24


def enter_venv(release: str | None) -> None:
    """Build or reuse the vLLM venv, then replace this process by the demo in it."""
    print("kvqueue demo: the CPU vLLM venv (vllm_tests/venv.sh; the first build: several "
          "minutes, 4 GB)", flush=True)  # fmt: skip
    venv = with_progress("vllm_tests/venv.sh", lambda: shown(["bash", str(VLLM_TESTS / "venv.sh")]))
    python = str(Path(venv) / "bin" / "python")
    env = {**os.environ, IN_VENV: "1"}
    path = [str(VLLM_TESTS)]
    if release is not None:
        # The venv's python decides which of the line's requirements it lacks.
        line = with_progress(
            f"vLLM {release}'s Python code (vllm_tests/lines.py)",
            lambda: shown([python, str(VLLM_TESTS / "lines.py"), release]),
        )
        path.append(line)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*path, env.get("PYTHONPATH")]))
    print(f"kvqueue demo: using {venv}", flush=True)
    os.execve(python, [python, __file__, *sys.argv[1:]], env)


class Failed(Exception):
    """A step of the demo's setup failed; its own messages were shown as it ran."""


def shown(command: list[str]) -> str:
    """What ``command`` prints on stdout, stripped; its stderr shown line by line as it comes,
    each on a line of its own (the progress counter's line cleared first). Raises Failed."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        assert child.stderr is not None
        errors = child.stderr

        def relay() -> None:
            for line in errors:
                print(f"{CLEAR}{line}", end="", file=sys.stderr, flush=True)

        relayed = threading.Thread(target=relay, daemon=True)
        relayed.start()
        out = child.stdout.read()
        relayed.join()
    if child.returncode != 0:
        raise Failed(
            f"{command[1]} failed (exit status {child.returncode}); its messages above say why"
        )
    return out.strip()


#: Clears the progress counter's line on a terminal (where the counter is shown).
CLEAR = "\r\033[K" if sys.stdout.isatty() else ""


def with_progress(label: str, call: Any) -> Any:
    """``call()``, with the seconds spent shown while it runs."""
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(1):
            if sys.stdout.isatty():
                print(f"{CLEAR}  {label}: {time.monotonic() - start:.0f} s", end="", flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        return call()
    finally:
        done.set()
        ticker.join()
        print(f"{CLEAR}  {label}: {time.monotonic() - start:.0f} s", flush=True)


def queue_name(qualified: str) -> str:
    if qualified.startswith("kvqueue._queue_py."):
        return "kvqueue, pure twin"
    if qualified.startswith("kvqueue._queue."):
        return "kvqueue, compiled twin"
    return "vLLM's own" if qualified.startswith("vllm.") else qualified


def tally(run: Any, expected: list[list[list[int]]]) -> dict[str, int]:
    """How many completions the user got right, got wrong, and never got."""
    right = wrong = 0
    # strict=False: a dead engine leaves rounds unserved
    for got_round, want_round in zip(run.result["outputs"], expected, strict=False):
        for got, want in zip(got_round, want_round, strict=True):
            right += got == want
            wrong += got != want
    return {"right": right, "wrong": wrong, "unserved": sum(map(len, expected)) - right - wrong}


def call_in(message: str) -> str:
    """The pool method a kvqueue message names."""
    found = re.search(r"BlockPool\.\w+\(\)", message)
    return found.group(0) if found else "?"


def one_line(event: dict[str, Any]) -> str:
    """An event's message as one line: kvqueue wraps its messages to 100 columns."""
    return " ".join(event["message"].split())


def at_fault(run: Any) -> tuple[str, str]:
    """What the pool did with the double free: (one cell, the whole message or '')."""
    # A refusal at the faulty call: a double free (ValueError), or a free of a reference its
    # holder still lists (HolderAuditError); the engine core dies of it, or the free is caught.
    faulty = ("double free", "would release block")
    refused = [(e.get("type", "ValueError"), one_line(e)) for e in run.events("refused")]
    refused += [
        (e["type"], one_line(e))
        for e in run.events("died")
        if any(what in one_line(e) for what in faulty)
    ]
    audited = [one_line(e) for e in run.events("died") if "holder audit" in one_line(e)]
    repaired = [
        one_line(e)
        for e in run.events("log")
        if "repaired a" in one_line(e) or "released a held reference" in one_line(e)
    ]
    violations = run.events("violation")
    if refused:
        kind, message = refused[0]
        return f"refused at {call_in(message)}: {kind}", message
    if audited:
        return "refused where the next step started: HolderAuditError", audited[0]
    if repaired:
        kind = re.search(r"\((\w+) #", repaired[0])
        kind_name = kind.group(1) if kind else "?"
        if "holder audit" in repaired[0]:
            return f"repaired where the next step started ({kind_name})", ""
        return f"repaired at {call_in(repaired[0])} ({kind_name})", ""
    if violations:
        return "accepted: " + violations[0]["found"][0], ""
    return "nothing seen", ""


def root_cause(run: Any) -> str:
    """The last exception line the engine core logged: why it did not start."""
    logged = r"^\(EngineCore[^)]*\).*?\] (\w+(?:Error|Exception): .*)$"
    errors = re.findall(logged, run.output, re.M)
    return f"the engine did not start: {errors[-1] if errors else run.result['error']}"


def excerpt(run: Any) -> str:
    """What stopped the engine, or kvqueue's refusal: printed whole below the table."""
    if not run.events("started"):
        return root_cause(run)
    refused = at_fault(run)[1]
    died = run.events("died")
    if refused or not died:
        return refused
    message = " ".join(died[0]["message"].split()) or "(no message)"
    return f"the engine core died of {died[0]['type']}: {message} at {died[0]['raised_at']}"


def afterwards(run: Any) -> str:
    violations = run.events("violation")
    died = run.events("died")
    if violations:
        steps = violations[-1]["violating_steps"]
        text = f"pool wrong in {steps} check{'s' if steps > 1 else ''}"
        text += "" if violations[-1]["found"] else ", then exact"
    else:
        text = "pool exact after every step"
    if died:
        text += f"; engine core died: {died[0]['type']} in {died[0]['raised_at'].split()[-1]}"
    return text


def describe(run: Any, expected: list[list[list[int]]]) -> dict[str, str]:
    """One column of the table: what the engine core saw and what the user got."""
    start = next(iter(run.events("started")), None)
    injected = run.events("injected")
    counts = tally(run, expected)
    total = sum(counts.values())
    error = run.result["error"]
    return {
        "queue": queue_name(start["queue"]) if start else "(the engine did not start)",
        "pool guard": ("on" if start["status"]["pool_guard"] else "off") if start else "?",
        "injected": (
            f"block {injected[0]['block']} (ref_cnt {injected[0]['ref_cnt']})"
            if injected
            else "none"
        ),
        "at the fault": at_fault(run)[0],
        "afterwards": afterwards(run),
        "served right": f"{counts['right']} of {total}",
        "served wrong": f"{counts['wrong']}, with no error" if counts["wrong"] else "none",
        "not served": (
            f"{counts['unserved']}: {error.split(':')[0]}" if counts["unserved"] else "none"
        ),
    }


def table(columns: dict[str, dict[str, str]]) -> str:
    rows = list(next(iter(columns.values())))
    lines = [" " * LABEL + "".join(f"{name:<{WIDTH + 2}}" for name in columns).rstrip()]
    lines.append("-" * SCREEN)
    for row in rows:
        cells = [textwrap.wrap(column[row], WIDTH) or [""] for column in columns.values()]
        for i in range(max(map(len, cells))):
            label = row if i == 0 else ""
            text = "".join(f"{(c[i] if i < len(c) else ''):<{WIDTH + 2}}" for c in cells)
            lines.append(f"{label:<{LABEL}}{text}".rstrip())
    return "\n".join(lines)


def verdict(counts: dict[str, dict[str, int]], stopped: bool, alone_pool_wrong: bool) -> str:
    """What each contender did to the users' completions, in lines of at most 100 columns."""
    alone, raised, repair = counts["vLLM alone"], counts["kvqueue raise"], counts["kvqueue repair"]
    total = sum(alone.values())
    if alone["wrong"]:
        said = f"vLLM alone served {alone['wrong']} of {total} wrong, silently"
    else:  # the damage may not have reached a completion yet (vLLM 0.18-0.23 lose the block)
        said = f"vLLM alone served {alone['right']} of {total} right"
        said += ", its pool wrong" if alone_pool_wrong else ""
    if alone["unserved"]:
        said += f", then its engine died with {alone['unserved']} unserved"
    if raised["wrong"]:
        said += f"; raise served {raised['wrong']} wrong"
    elif stopped:
        said += (
            f"; raise stopped at the fault, before serving anything wrong ({raised['right']} "
            f"of {total} served)"
        )
    if not stopped:
        said += "; raise did not stop"
    said += f"; repair served {repair['right']} of {total} right"
    return textwrap.fill(f"verdict: {said}", SCREEN, subsequent_indent="  ")


def main() -> int:
    # The docstring's first paragraph, without its reST markup: argparse rewraps it.
    summary = __doc__.split("\n\n")[0].replace("``", "")
    forms = "; ".join(f"{form}: {what}" for form, what in FORMS.items())
    parser = argparse.ArgumentParser(description=summary)
    parser.add_argument(
        "--form", choices=sorted(FORMS), default="A", help=f"the double free injected ({forms})"
    )
    parser.add_argument("--vllm", help="the vLLM release to run (default: the venv's own)")
    args = parser.parse_args()
    if not os.environ.get(IN_VENV):
        try:
            enter_venv(args.vllm)
        except Failed as exc:
            print(f"kvqueue demo: {exc}", file=sys.stderr)
            return 2
    import vllm
    from live import driver

    import kvqueue
    import kvqueue.vllm

    if args.vllm is not None and vllm.__version__.split("+")[0] != args.vllm:
        print(f"kvqueue demo: vLLM {vllm.__version__} imported, not {args.vllm}", file=sys.stderr)
        return 2
    print(textwrap.fill(
        f"kvqueue {kvqueue.__version__} ({kvqueue.IMPLEMENTATION}), vLLM {vllm.__version__}; "
        f"form {args.form}: {FORMS[args.form]}; vllm.LLM serves {ROUNDS} rounds of {REQUESTS} "
        "requests (stub model with a KV cache on the CPU, engine core in its own process)",
        SCREEN,
    ))  # fmt: skip
    expected = driver.completions(ROUNDS, REQUESTS, MAX_TOKENS)
    scenarios = {
        "vLLM alone": (None, None),
        "kvqueue raise": ("1", "raise"),
        "kvqueue repair": ("1", "repair"),
    }
    blocks = ("--blocks", str(BLOCKS[args.form])) if args.form in BLOCKS else ()
    columns: dict[str, dict[str, str]] = {}
    counts: dict[str, dict[str, int]] = {}
    excerpts: dict[str, str] = {}
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as work:
        for name, (setting, policy) in scenarios.items():
            env = "no KVQUEUE_*"
            if setting:
                env = f"KVQUEUE_VLLM={setting} KVQUEUE_ON_MISUSE={policy}"
            runs[name] = run = with_progress(
                f"{name} ({env})",
                lambda s=setting, p=policy: driver.run(
                    Path(work), s, p, args.form,
                    args=("--rounds", str(ROUNDS), "--requests", str(REQUESTS),
                          "--max-tokens", str(MAX_TOKENS), *blocks),
                ),
            )  # fmt: skip
            columns[name] = describe(run, expected)
            counts[name] = tally(run, expected)
            excerpts[name] = excerpt(run)
    print()
    print(table(columns))
    print("-" * SCREEN)
    for name, message in excerpts.items():
        if message:
            print(textwrap.fill(f"{name}: {message}", SCREEN, subsequent_indent="  "))
    repair, raised = runs["kvqueue repair"], runs["kvqueue raise"]
    stopped = bool(at_fault(raised)[1]) and raised.result["error"] is not None
    alone_violations = runs["vLLM alone"].events("violation")
    print(verdict(counts, stopped, bool(alone_violations and alone_violations[-1]["found"])))
    # What the demo shows is what kvqueue claims: CI runs it, so a claim that fails fails it.
    shown = (
        counts["kvqueue repair"]["right"] == sum(counts["kvqueue repair"].values())
        and not repair.events("died")
        and (not repair.events("violation") or not repair.events("violation")[-1]["found"])
        and stopped
        and counts["kvqueue raise"]["wrong"] == 0
    )
    if not shown:
        print("kvqueue demo: kvqueue did not do what this demo says it does", file=sys.stderr)
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main())
