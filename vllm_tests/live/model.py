"""A config-only model directory: what vLLM reads of a model when nothing runs its weights.

The stub executor answers for the model, so vLLM needs only the Hugging Face configuration
(architecture, sizes, vocabulary); there are no weights and no tokenizer (the engine runs
with ``skip_tokenizer_init=True`` and token-id prompts), and nothing is downloaded.
"""

from __future__ import annotations

import json
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
