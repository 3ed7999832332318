"""A run's geometry, derived once from its `RunConfig` and model: the widths, limits and counts that
the data sources, the generator's engine and the memory plan all size themselves by.

    shapes = RunShapes.of(model_config, run_config)

`experiment.run_experiment` derives it once and hands it to the memory plan (`memory_plan.plan_run`)
and the `Controller` (which builds the engine from it); the data sources cut prompts at
`shapes.prompt_limit`. A plan made from the same `RunShapes` as the engine counts the engine's KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamarl_jax.config import RunConfig
from llamarl_jax.generation.paged import PageLayout
from llamarl_jax.generation.sampler import prompt_bucket
from llamarl_jax.model.config import ModelConfig

DEFAULT_PROMPT_LIMIT = 512  # the slot engine's first-prompt limit when GeneratorConfig.max_prompt_len is unset


@dataclass(frozen=True)
class RunShapes:
  """The run's geometry (token counts are positions of one row).

  rows: rows of one step's batch (prompts_per_step x samples_per_prompt).
  max_new_tokens: tokens one generate call samples per row (one turn).
  response_width: R, the trainer's response positions: max_new_tokens, or for a multi-turn episode
    room for every turn and observation (`EnvConfig.response_width`).
  prompt_limit: the longest first prompt the run takes (the data sources cut or refuse longer ones):
    `GeneratorConfig.max_prompt_len`, default 512, never more than the context minus R; the static
    sampler: the context minus R.
  engine_prompt_len: the longest prompt the generator is built for, rounded up to a prompt bucket
    (`sampler.prompt_bucket`): a later turn's prompt is the episode so far, so a multi-turn run adds
    R - max_new_tokens. The slot engine's `max_prompt_len` and each KV prompt region's length.
  lanes: rows one decode step computes (`GeneratorConfig.slots`, default the rows rounded up to a
    multiple of the generator's data-parallel size).
  staged_slots: KV slots beyond the lanes (`GeneratorConfig.staged_slots`).
  versions_held: copies of the generator's weights held at most (`memory_plan.generator_versions`).
  kv_block_size: positions per block of the slot engine's paged KV pool.
  engine: "slots" or "static" (`GeneratorConfig.engine`).
  """
  rows: int
  max_new_tokens: int
  response_width: int
  prompt_limit: int
  engine_prompt_len: int
  lanes: int
  staged_slots: int
  versions_held: int
  kv_block_size: int
  engine: str

  @classmethod
  def of(cls, model_config: ModelConfig, run: RunConfig) -> "RunShapes":
    r, g = run.rollout, run.generator
    width = run.env.response_width(r.max_new_tokens)
    room = max(1, model_config.max_position_embeddings - width)
    limit = min(g.max_prompt_len or DEFAULT_PROMPT_LIMIT, room) if g.engine == "slots" else room
    later_turns = width - r.max_new_tokens if run.env.multi_turn else 0
    dp = run.mesh.generator_dp
    return cls(rows=r.rows, max_new_tokens=r.max_new_tokens, response_width=width, prompt_limit=limit,
               engine_prompt_len=prompt_bucket(limit + later_turns), lanes=g.slots or -(-r.rows // dp) * dp,
               staged_slots=g.staged_slots, versions_held=generator_versions(run), kv_block_size=g.kv_block_size,
               engine=g.engine)

  @property
  def slots(self) -> int:
    """KV slots of the slot engine: the lanes' and the staged ones."""
    return self.lanes + self.staged_slots

  @property
  def page_layout(self) -> PageLayout:
    """The slot engine's KV pool layout."""
    return PageLayout(self.slots, self.engine_prompt_len, self.max_new_tokens, self.kv_block_size)

  @property
  def kv_pool_positions(self) -> int:
    """Positions (per layer, K and V each) of the generator's KV cache: the slot engine's whole paged
    pool (prompt regions, response blocks, trash block); the static sampler's one batch of rows x
    (engine_prompt_len + R)."""
    if self.engine == "slots":
      return self.page_layout.num_blocks * self.kv_block_size
    return self.rows * (self.engine_prompt_len + self.response_width)


def generator_versions(run: RunConfig) -> int:
  """Copies of the generator's weights a run holds at most: the WeightSync's ('fixed': max_policy_lag
  + 1 versions may wait; 'latest': the newest) plus the engine's own."""
  waiting = run.schedule.max_policy_lag + 1 if run.schedule.version_schedule == "fixed" else 1
  return waiting + 1
