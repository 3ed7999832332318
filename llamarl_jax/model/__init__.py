"""The decoder (Flax NNX) for Llama 3 and Qwen2 / Qwen2.5 / Qwen3 dense, and Hugging Face checkpoint conversion."""

from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import KVCache, Llama, init_model, merge_params, split_params
from llamarl_jax.model.hf import load_hf_checkpoint, load_tokenizer, save_hf_checkpoint

__all__ = ["KVCache", "Llama", "ModelConfig", "init_model", "merge_params", "split_params",
           "load_hf_checkpoint", "load_tokenizer", "save_hf_checkpoint"]
