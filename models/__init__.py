"""Flax decoder for Llama / Qwen2 / Qwen3 / Mistral checkpoints, with HF loading."""
from .config import MODEL_TYPES, ModelConfig, rope_inv_freq
from .decoder import (Model, attention_inputs, attention_projection, embed, finish_layer,
                      forward, init_params, logits, param_shapes, token_ids, unembed)
from .loading import from_pretrained, hf_state_dict, load_params, load_tokenizer, save_pretrained

__all__ = [
    "MODEL_TYPES", "Model", "ModelConfig", "attention_inputs", "attention_projection", "embed",
    "finish_layer", "forward", "from_pretrained", "hf_state_dict", "init_params", "load_params",
    "load_tokenizer", "logits", "param_shapes", "rope_inv_freq", "save_pretrained", "token_ids",
    "unembed",
]
