"""Start vLLM on the CPU as a user does, serve rounds of requests, report as JSON.

``python -m live.driver --out RESULT.json`` (``vllm_tests`` on ``PYTHONPATH``) runs one engine:
``vllm.LLM`` (or ``AsyncLLM`` with ``--api async``) with V1 multiprocessing on (the engine core
in its own process, started as vLLM's platform decides), the stub executor by qualified name,
``skip_tokenizer_init=True``, token-id prompts, prefix caching, the config-only model, and
(unless ``--plain``) the checked scheduler. Whether kvqueue is in is the environment's business
(``KVQUEUE_VLLM``, ``KVQUEUE_ON_MISUSE``), exactly as for a user; the test-only variables of
``live.scheduler`` drive the injection.

:func:`run` starts the driver in a fresh process with such an environment and gives back its
result, the engine core's journal and the combined output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import no_triton

from live import INJECT, INJECT_COUNT, JOURNAL, model

# vLLM 0.34+ refuses an x86 CPU without triton-cpu; the stub model runs no kernel. At import:
# an engine core that vLLM spawns imports this module again (as __mp_main__) before it checks
# its config.
no_triton.allow()

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 16
#: Request i of every round starts with the same two-block prefix, its own: round r + 1's
#: request i hits round r's in the prefix cache (one request per cached prefix block, so a
#: block a double free left in the free list stays there once the hit takes it); the rest of
#: each prompt is new and evicts older blocks.
PREFIX = 2 * BLOCK_SIZE
#: A pool a little larger than a round's peak (about 120 blocks): a round's blocks stay cached
#: for the next, which evicts most of them.
NUM_BLOCKS = 160
VOCAB = model.VOCAB


def prompts(round_: int, count: int) -> list[list[int]]:
    """The token ids of round ``round_``'s ``count`` prompts (same arguments, same prompts)."""
    result = []
    for index in range(count):
        shared = random.Random(f"prefix {index}")
        own = random.Random(f"round {round_} request {index}")
        prefix = [shared.randrange(3, VOCAB) for _ in range(PREFIX)]
        result.append(prefix + [own.randrange(3, VOCAB) for _ in range(own.randint(8, 72))])
    return result


def completions(rounds: int, requests: int, max_tokens: int) -> list[list[list[int]]]:
    """What a right engine answers to each prompt of each round (``model.completion``)."""
    return [
        [model.completion(prompt, max_tokens) for prompt in prompts(round_, requests)]
        for round_ in range(rounds)
    ]


def engine_kwargs(model_dir: Path, *, plain: bool, blocks: int = NUM_BLOCKS) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "distributed_executor_backend": "live.executor.StubExecutor",
        "enable_prefix_caching": True,
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks_override": blocks,
        "max_model_len": model.MAX_LEN,
        "seed": 0,
    }
    if not plain:
        kwargs["scheduler_cls"] = "live.scheduler.CheckedScheduler"
    return kwargs


def serve_args() -> list[str]:
    """The same engine settings as ``vllm serve`` options (the model given apart)."""
    args = []
    for name, value in engine_kwargs(Path(), plain=False).items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def _sampling(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def serve_llm(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_kwargs(args.model, plain=args.plain, blocks=args.blocks))
    result["startup_seconds"] = time.monotonic() - result.pop("_start")
    result["report"] = llm.collective_rpc("kvqueue_report")[0]
    for round_ in range(args.rounds):
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(round_, args.requests)]
        start = time.monotonic()
        outputs = llm.generate(batch, _sampling(args.max_tokens), use_tqdm=False)
        _record_round(result, start, [list(o.outputs[0].token_ids) for o in outputs])


async def serve_async(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**engine_kwargs(args.model, plain=args.plain, blocks=args.blocks))
    )
    try:
        result["startup_seconds"] = time.monotonic() - result.pop("_start")
        result["report"] = (await engine.collective_rpc("kvqueue_report"))[0]
        params = _sampling(args.max_tokens)

        async def one(request_id: str, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            async for output in engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, request_id
            ):
                tokens = list(output.outputs[0].token_ids)
            return tokens

        for round_ in range(args.rounds):
            start = time.monotonic()
            batch = prompts(round_, args.requests)
            outputs = await asyncio.gather(*(one(f"{round_}-{i}", p) for i, p in enumerate(batch)))
            _record_round(result, start, outputs)
    finally:
        engine.shutdown()


def _record_round(result: dict[str, Any], start: float, outputs: list[list[int]]) -> None:
    result["rounds"].append(
        {
            "seconds": time.monotonic() - start,
            "requests": len(outputs),
            "tokens": sum(map(len, outputs)),
        }
    )
    result["outputs"].append(outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="write the result here (JSON)")
    parser.add_argument("--model", type=Path, required=True, help="config-only model directory")
    parser.add_argument("--api", choices=("llm", "async"), default="llm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20, help="requests a round")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--plain", action="store_true", help="vLLM's scheduler, unchecked")
    parser.add_argument("--blocks", type=int, default=NUM_BLOCKS, help="KV blocks in the pool")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "_start": time.monotonic(),
        "pid": os.getpid(),
        "rounds": [],
        "outputs": [],
        "error": None,
    }
    try:
        if args.api == "llm":
            serve_llm(args, result)
        else:
            asyncio.run(serve_async(args, result))
    except Exception as error:  # the engine core died: what the user is told is the result
        result["error"] = f"{type(error).__name__}: {error}"
    result.pop("_start", None)
    args.out.write_text(json.dumps(result), encoding="utf-8")
    return 0


@dataclass
class Run:
    """One driver run: its result, the engine core's journal, and everything it printed."""

    result: dict[str, Any]
    journal: list[dict[str, Any]]
    output: str
    seconds: float
    env: dict[str, str] = field(default_factory=dict)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [entry for entry in self.journal if entry["event"] == name]

    @property
    def completed(self) -> int:
        return sum(r["requests"] for r in self.result["rounds"])


#: What a run's environment never inherits: it says for itself whether kvqueue is in.
_OWN = (
    "KVQUEUE_VLLM",
    "KVQUEUE_ON_MISUSE",
    "KVQUEUE_POOL_GUARD",
    "VLLM_PLUGINS",
    INJECT,
    INJECT_COUNT,
)


def run(
    work: Path,
    kvqueue: str | None,
    policy: str | None = None,
    inject: str | None = None,
    *,
    inject_count: int = 1,
    extra_env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
    timeout: float = 300,
) -> Run:
    """Run the driver in a fresh process; ``kvqueue`` is ``KVQUEUE_VLLM`` (None: unset).

    ``work`` holds the model directory and a new directory of this run's files.
    Raises ``subprocess.TimeoutExpired`` past ``timeout`` and RuntimeError when the driver
    itself fails (not the engine: an engine's death is in the result).
    """
    model_dir = model.write(work / "model")
    name = "-".join(filter(None, [kvqueue or "vllm", policy, inject, *args])).replace("--", "")
    files = Path(tempfile.mkdtemp(prefix=name + "-", dir=work))
    out, journal = files / "result.json", files / "journal"
    env = {k: v for k, v in os.environ.items() if k not in _OWN}
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")])),
        **{JOURNAL: str(journal)},
    )
    if kvqueue is not None:
        env["KVQUEUE_VLLM"] = kvqueue
    if policy is not None:
        env["KVQUEUE_ON_MISUSE"] = policy
    if inject is not None:
        env[INJECT] = inject
        env[INJECT_COUNT] = str(inject_count)
    env.update(extra_env or {})
    command = [
        sys.executable,
        "-m",
        "live.driver",
        "--out",
        str(out),
        "--model",
        str(model_dir),
        *args,
    ]
    start = time.monotonic()
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    output = done.stdout + done.stderr
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{output[-4000:]}")
    lines = journal.read_text(encoding="utf-8").splitlines() if journal.is_file() else []
    return Run(
        result=json.loads(out.read_text(encoding="utf-8")),
        journal=[json.loads(line) for line in lines],
        output=output,
        seconds=time.monotonic() - start,
        env={k: env[k] for k in (*_OWN, JOURNAL) if k in env},
    )


if __name__ == "__main__":
    sys.exit(main())
