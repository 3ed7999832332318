"""Generation: the sampler, the slot engine's paged KV layout (and the rollout data types of `batch`)."""
from llamarl_jax.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch, ScoredBatch
from llamarl_jax.generation.sampler import Sampler, SamplingParams, sample_logits
