"""Flax decoder for Llama / Qwen2 / Qwen3 / Mistral checkpoints, with HF and GGUF loading."""
from .config import MODEL_TYPES, ModelConfig, rope_inv_freq
from .decoder import (Model, attention_inputs, attention_projection, embed, finish_layer,
                      forward, fuse_layer, init_params, is_stacked, layer_params, logits,
                      param_shapes, split_layer, stack_layers, token_ids, unembed,
                      unstack_layers)
from .loading import (from_pretrained, hf_state_dict, load_params, load_tokenizer, real_model_path,
                      save_pretrained)

__all__ = [
    "MODEL_TYPES", "Model", "ModelConfig", "attention_inputs", "attention_projection", "embed",
    "finish_layer", "forward", "from_pretrained", "fuse_layer", "hf_state_dict", "init_params",
    "is_stacked", "layer_params", "load_params", "load_tokenizer", "logits", "param_shapes",
    "real_model_path", "rope_inv_freq", "save_pretrained", "split_layer", "stack_layers",
    "token_ids", "unembed", "unstack_layers",
]
