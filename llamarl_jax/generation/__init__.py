"""Generation: rollout data types, the sampler, the slot engine's paged KV layout."""
from llamarl_jax.generation.rollout import FINISH_LENGTH, FINISH_STOP, RolloutBatch, ScoredBatch
from llamarl_jax.generation.sampler import Sampler, SamplingParams, sample_logits
