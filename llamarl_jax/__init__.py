"""llamarl_jax: asynchronous off-policy RL post-training of LLMs in JAX (LlamaRL)."""
__version__ = "0.1.0"
