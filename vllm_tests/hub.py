"""A local Hugging Face hub cache holding only the ``config.json`` of the models vLLM's tests name.

vLLM's scheduler and connector tests build a ``ModelConfig`` from a hub model id and read
only its configuration; no weights and no tokenizer are loaded. ``python hub.py DIR`` writes
``DIR/hub/models--ORG--NAME/snapshots/<rev>/config.json`` and ``refs/main`` for each model
below, so that with ``HF_HOME=DIR`` and ``HF_HUB_OFFLINE=1`` the id resolves offline.
The values are those of the models' published configurations (architecture and sizes).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REVISION = "0" * 40

CONFIGS: dict[str, dict[str, Any]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
        "word_embed_proj_dim": 768,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "torch_dtype": "float16",
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": 1024,
        "ffn_dim": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
        "word_embed_proj_dim": 512,
        "do_layer_norm_before": False,
        "activation_function": "relu",
        "torch_dtype": "float16",
        "pad_token_id": 1,
        "bos_token_id": 2,
        "eos_token_id": 2,
    },
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "image_token_index": 32000,
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128000,
        "max_window_layers": 70,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "hidden_act": "silu",
        "sliding_window": 32768,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    },
    "meta-llama/Llama-3.2-1B-Instruct": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
}


def write(home: Path) -> None:
    """Write every config under ``home/hub``; O(number of models). Raises OSError."""
    for model, config in CONFIGS.items():
        repo = home / "hub" / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION, encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
