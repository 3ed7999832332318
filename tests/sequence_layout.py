"""A reference layout for tests: a left-padded prompt and its response as one sequence with explicit
positions and an attention mask (the trainer itself uses `batch.trainer_layout`)."""

import jax.numpy as jnp


def sequence_layout(prompt_tokens, prompt_mask, response_tokens, response_mask):
  """Concatenate a left-padded prompt and its response into one sequence.

  Returns tokens `[B, P+R]`, positions `[B, P+R]` (0 at the first real prompt token, as the sampler
  assigned them) and attention_mask `[B, P+R]`. The logits at index P-1+t predict response token t.
  """
  tokens = jnp.concatenate([prompt_tokens, response_tokens], axis=1)
  mask = jnp.concatenate([prompt_mask, response_mask], axis=1).astype(jnp.int32)
  positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
  return tokens, positions, mask
