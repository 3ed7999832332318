"""Generation: rollout data types and the sampler."""
from llamarl_jax.generation.rollout import FINISH_LENGTH, FINISH_STOP, RolloutBatch, ScoredBatch
