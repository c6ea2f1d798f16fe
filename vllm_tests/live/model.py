"""The stub model: a config-only model directory for vLLM, and the function the stub computes.

vLLM reads only the Hugging Face configuration (architecture, sizes, vocabulary): there are no
weights and no tokenizer (the engine runs with ``skip_tokenizer_init=True`` and token-id
prompts), and nothing is downloaded. What the model computes is :func:`next_token`: the stub
executor evaluates it on what its KV cache holds for a request (``live.executor``), the demo and
the tests on the request's tokens (:func:`completion`). The two agree exactly when the engine
gave the request KV blocks that nobody else wrote.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

#: A small Llama: the sizes only shape the KV cache spec the stub reports.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write(directory: Path) -> Path:
    """Write ``config.json`` into ``directory`` (made if missing) and return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=1), encoding="utf-8")
    return directory


VOCAB: int = CONFIG["vocab_size"]  # type: ignore[assignment]
#: The longest context: the engine's ``max_model_len``.
MAX_LEN = 512
#: One weight per position: every token of the context moves the next one, so a KV slot that
#: holds another request's token changes the answer (but for a chance of 1 in ~VOCAB).
WEIGHTS: list[int] = [random.Random(f"weight {i}").randrange(1, 1 << 20) for i in range(MAX_LEN)]


def next_token(context: Sequence[int]) -> int:
    """The token the stub model samples after ``context``."""
    # strict=False: a context is never longer than MAX_LEN, the weights' count
    return sum(token * weight for token, weight in zip(context, WEIGHTS, strict=False)) % VOCAB


def completion(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The ``max_tokens`` tokens a right engine generates for ``prompt``."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]
