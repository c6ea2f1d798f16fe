"""Seeded serving workloads for vLLM's real scheduler: who arrives when, with which tokens.

A workload is fixed in advance from a seed, independently of any queue: per request its
arrival step, its prompt (a recent request's whole conversation, i.e. a follow-up turn; else
one of a few shared system prompts, picked with Zipf weights; else nothing; then a short
unique tail) and the output tokens the fake model will "sample" for it, one per decode step.
Outputs are fixed so that a follow-up's prompt really is an earlier request's prompt plus
its output, and can hit the prefix cache the earlier request filled.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    num_blocks: int  # KV-cache blocks, the null block included
    block_size: int
    steps: int  # scheduler steps run
    warmup_steps: int  # the first steps fill the cache; timing starts after them
    arrivals_per_step: float  # Poisson mean
    max_num_seqs: int  # batch slots
    max_num_batched_tokens: int  # token budget per step (chunked prefill)
    num_system_prompts: int
    system_prompt_blocks: tuple[int, int]  # full blocks, inclusive range
    shared_fraction: float  # share of requests that start with a system prompt
    tail_tokens: tuple[int, int]  # unique prompt tail, inclusive range
    output_tokens: tuple[int, int]  # inclusive range
    followup_fraction: float  # share of requests that continue a recent conversation
    followup_window: int  # ... chosen among this many latest requests
    max_context_tokens: int  # a follow-up longer than this starts a new conversation
    vocab: int = 32000


DECODE_HEAVY = Workload(
    name="decode-heavy", seed=6, num_blocks=4096, block_size=16, steps=1200, warmup_steps=300,
    arrivals_per_step=0.25, max_num_seqs=128, max_num_batched_tokens=8192,
    num_system_prompts=4, system_prompt_blocks=(2, 8), shared_fraction=0.3,
    tail_tokens=(16, 128), output_tokens=(128, 1024),
    followup_fraction=0.2, followup_window=32, max_context_tokens=4096,
)  # fmt: skip
# The same engine, many short requests on popular long prompts.
PREFIX_HEAVY = replace(
    DECODE_HEAVY, name="prefix-heavy", steps=800, warmup_steps=200,
    arrivals_per_step=2.0, max_num_seqs=64,
    num_system_prompts=16, system_prompt_blocks=(16, 64), shared_fraction=0.9,
    tail_tokens=(8, 96), output_tokens=(8, 64),
    followup_fraction=0.4, followup_window=256,
)  # fmt: skip
WORKLOADS = {w.name: w for w in (DECODE_HEAVY, PREFIX_HEAVY)}


@dataclass(frozen=True)
class Spec:
    """One request of a workload: vLLM's ``Request`` is built from it when it arrives."""

    request_id: str
    arrival_step: int
    prompt: list[int]
    output: list[int]


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def make_workload(w: Workload) -> list[Spec]:
    """The seeded request list of ``w``, in arrival order. O(total tokens)."""
    rng = random.Random(w.seed)
    system_prompts = [
        [rng.randrange(w.vocab) for _ in range(w.block_size * rng.randint(*w.system_prompt_blocks))]
        for _ in range(w.num_system_prompts)
    ]
    # Prompt i is picked with weight 1/(i+1): unpopular ones go idle and their cached blocks
    # sit in the free queue until a later hit takes them out of its middle.
    weights = [1 / (i + 1) for i in range(w.num_system_prompts)]
    specs: list[Spec] = []
    for step in range(w.steps):
        for _ in range(_poisson(rng, w.arrivals_per_step)):
            prefix: list[int] = []
            if specs and rng.random() < w.followup_fraction:
                previous = rng.choice(specs[-w.followup_window :])
                conversation = previous.prompt + previous.output
                if (
                    len(conversation) + w.tail_tokens[1] + w.output_tokens[1]
                    <= w.max_context_tokens
                ):
                    prefix = conversation
            if not prefix and rng.random() < w.shared_fraction:
                prefix = rng.choices(system_prompts, weights)[0]
            tail = [rng.randrange(w.vocab) for _ in range(rng.randint(*w.tail_tokens))]
            output = [rng.randrange(w.vocab) for _ in range(rng.randint(*w.output_tokens))]
            specs.append(Spec(f"req-{len(specs)}", step, prefix + tail, output))
    return specs
