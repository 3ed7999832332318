"""The run's configuration: small frozen dataclasses, each validating its own fields once.

  MeshConfig       where the trainer, the generator and a reward model run (device counts per mesh axis)
  RolloutConfig    what is sampled per step (prompts, samples, sampling parameters, advantages, seed)
  GeneratorConfig  how it is sampled (engine, slots, chunk, dtype of the generator's weights)
  TrainConfig      the objective and the optimizer (loss, its kwargs, KL reference, microbatches, remat,
                   checkpoints; a critic: CriticConfig; the step's layout: TrainLayout), with its parts in
                   `train_config` (re-exported here)
  ScheduleConfig   the asynchronous part (max_policy_lag, version schedule, buffer, stall timeout)
  RewardConfig     the reward function and its worker pool; optionally a reward model combined with it
  EnvConfig        what an episode is: one turn, or turns with tool calls (llamarl_jax.envs)
  RunConfig        the seven together, with the checks that need more than one of them

Each field is checked in exactly one place: its class's `RULES` (`field_rules`: applied by
`__post_init__`, and by `config_check` to gin bindings before anything is built, so every bad binding
is reported at once).
Choice lists come from the modules that own them (losses, advantages, schedule, ...), never repeated.
No gin here: `experiment.py` registers these classes with gin (`MeshConfig.trainer_fsdp = 2`, ...).
A gin binding of a flat `Controller.<key>` gets an error naming the typed key that holds the setting
(`FLAT_KEYS`, `flat_binding_problems`); `run_config(**flat)` builds a RunConfig from the flat names.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llamarl_jax.advantages import ADVANTAGE_ESTIMATORS
from llamarl_jax.field_rules import ConfigError, Validated, above, at_least, between, int_at_least, one_of
from llamarl_jax.live import LiveResource
from llamarl_jax.model.config import GROUPED_GEMMS, WeightLayout, quantize_problem
from llamarl_jax.model.paged_attention import PAGED_IMPLEMENTATIONS
from llamarl_jax.schedule import VERSION_SCHEDULES
from llamarl_jax.train_config import (  # noqa: F401  (re-exported: the trainer's section of the run's configuration)
    LORA_TARGETS, LR_SCHEDULES, TRAIN_LAYOUTS, CriticConfig, LoraConfig, OptimizerConfig, TrainConfig, TrainLayout,
    loss_kwargs_problems, loss_names)

GENERATOR_ENGINES = ("slots", "static")
GENERATOR_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class MeshConfig(Validated):
  """Device counts of the meshes (`parallel.make_meshes`); colocated: trainer and generator on one mesh,
  taking turns. reward_dp x reward_tp: the reward model's own devices after theirs
  (`parallel.make_reward_mesh`; across processes, those of the reward processes); reward_dp = 0: it
  runs on the generator's mesh (one process only)."""
  trainer_fsdp: int = 1
  trainer_tp: int = 1
  generator_dp: int = 1
  generator_tp: int = 1
  colocated: bool = False
  reward_dp: int = 0
  reward_tp: int = 1
  trainer_expert: int = 1    # a MoE model's experts sharded over this many devices (`parallel`'s `expert` axis)
  generator_expert: int = 1
  RULES: ClassVar = {**{k: at_least(1) for k in ("trainer_fsdp", "trainer_tp", "generator_dp", "generator_tp",
                                                 "reward_tp", "trainer_expert", "generator_expert")},
                     "reward_dp": int_at_least(0)}


@dataclass(frozen=True)
class OverlongShaping(Validated):
  """DAPO's overlong reward shaping and overlong filtering (Yu et al. 2025, arXiv:2503.14476, sec. 3.4).

  buffer_len: L_cache, the soft-penalty zone: responses longer than max_new_tokens - buffer_len get
    `scoring.overlong_penalty` added to their reward (0 = off). DAPO used L_max = 20480, L_cache = 4096.
  penalty_factor: scales the penalty (verl's `overlong_buffer.penalty_factor`; DAPO: 1).
  mask_truncated: responses cut at max_new_tokens (finish reason "length") get a zero response mask,
    so they carry no loss and do not count in its normaliser (DAPO's overlong filtering); they still
    count in their group's advantage statistics. Lag metrics are then over the trained tokens.
  The default is off: rewards and masks unchanged.
  """
  buffer_len: int = 0
  penalty_factor: float = 1.0
  mask_truncated: bool = False
  RULES: ClassVar = {"buffer_len": int_at_least(0), "penalty_factor": at_least(0.0)}

  @property
  def enabled(self) -> bool:
    return self.buffer_len > 0 or self.mask_truncated


@dataclass(frozen=True)
class DynamicSampling(Validated):
  """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, eq. 11): drop the groups whose
  rewards are all equal (zero advantage under group-relative estimators: no signal) and keep drawing
  prompts until the batch holds prompts_per_step informative groups.

  max_draws: draws of prompts_per_step prompts per batch at most (the first included, >= 1). When they
    run out, the batch is completed with uninformative groups in draw order (the trainer's shapes are
    fixed), counted in dynamic_sampling/frac_groups_uninformative.
  Every draw of batch k uses batch k's policy version and the seed `draw_seed(seed, k, draw)`; prompts
  come from the one prompt source in order, so the run stays a pure function of the seed, and the
  data position recorded with batch k is the one after its last draw (resume). Rewards are scored in
  the generator loop (every generator process scores every row; the time counts as generation) and
  travel with the batch. Draws follow one another: a draw starts once the previous one is scored.
  """
  max_draws: int = 4
  RULES: ClassVar = {"max_draws": int_at_least(1)}


@dataclass(frozen=True)
class RolloutConfig(Validated):
  """Per step: `prompts_per_step` prompts x `samples_per_prompt` samples, sampled with these settings;
  advantages by `advantage_estimator` (advantages.py). `seed` fixes every batch's sampling noise.
  DAPO's `overlong` reward shaping and `dynamic_sampling` (None: off) shape what a batch holds.
  `exact_logprobs`: the generator and the trainer compute every op in its batch-invariant form
  (`model.exact`; a mixture of experts' routing and grouped matmuls included), so at lag 0 a token's
  behaviour log-prob equals the trainer's bit for bit; it spans both roles, like `temperature`, and
  needs unfiltered sampling (top_k = 0, top_p = 1): see `RunConfig.exact_logprobs_problems` for what
  else it refuses."""
  prompts_per_step: int = 8
  samples_per_prompt: int = 4
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 16
  advantage_estimator: str = "group_mean"
  seed: int = 0
  overlong: OverlongShaping = field(default_factory=OverlongShaping)
  dynamic_sampling: DynamicSampling | None = None
  exact_logprobs: bool = False
  RULES: ClassVar = {
      "prompts_per_step": at_least(1), "max_new_tokens": at_least(1), "temperature": at_least(0.0),
      "top_p": between(0.0, 1.0, lo_open=True), "top_k": at_least(0), "seed": at_least(0),
      "advantage_estimator": one_of(*ADVANTAGE_ESTIMATORS),
      # every estimator compares the samples of one prompt
      "samples_per_prompt": lambda v: None if v >= 2 else ">= 2 (the advantage compares a prompt's samples)"}

  @property
  def rows(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt

  def __post_init__(self):
    super().__post_init__()
    if self.overlong.buffer_len > self.max_new_tokens:
      raise ConfigError(f"OverlongShaping.buffer_len ({self.overlong.buffer_len}) must be <= "
                        f"RolloutConfig.max_new_tokens ({self.max_new_tokens}): the penalty zone is the last "
                        "buffer_len tokens before the limit")
    if self.exact_logprobs and (self.top_k or self.top_p < 1):
      raise ConfigError(f"RolloutConfig.exact_logprobs = True with RolloutConfig.top_k={self.top_k}, "
                        f"top_p={self.top_p}: exact behaviour log-probs are those of unfiltered temperature "
                        "sampling (a filtered distribution is renormalised over a set the trainer does not "
                        "see); set top_k = 0 and top_p = 1.0, or RolloutConfig.exact_logprobs = False")


@dataclass(frozen=True)
class GeneratorConfig(Validated):
  """The generator: `engine` 'slots' (a `SlotEngine`: continuous batching over `slots` KV slots,
  default rows per step) or 'static' (`Sampler.generate` per batch).
  Slot engine settings: decode chunks of `chunk_steps`; prompts up to `max_prompt_len` tokens, default
  min(512, context - max_new_tokens); KV kept across weight swaps unless `recompute_kv`; a paged KV
  pool of `kv_block_size` positions per block; `chunks_in_flight` decode chunks dispatched before the
  host waits; `paged_attention` the decode attention's form (`paged_attention.PAGED_IMPLEMENTATIONS`):
  'auto' (on one GPU the Pallas kernel form that has passed on a GPU, `gpu_paths`; XLA's elsewhere),
  'reduce', 'dot', 'pallas' (one kernel that reads each live block once, on a one-device generator
  mesh) or 'pallas_fused' (that kernel also writing the new key and value in place, with fp8 weights
  the fp8 activation kernels; opt-in until it passes on a GPU);
  `min_decode_width` the fewest rows a decode chunk computes when few slots are busy (the batch
  shrinks to the busy slots in halvings; None: slots / 16; = slots: it never shrinks); `staged_slots`
  KV slots beyond `slots`: prompts prefilled ahead that decode chunks admit on device as rows finish.
  Both: `dtype` of the weights; `quantize` their precision (`model.config.QUANTIZATIONS`): None (all
  in `dtype`), 'fp8' (the projections in float8_e4m3fn with per-output-channel scales, computed as
  fp8 GEMMs; the trainer quantises before the wire, or the generator after a LoRA merge: `model.fp8`)
  or 'fp8+lm_head' (the lm_head in fp8 too, a scale per vocabulary row; tied embeddings: an fp8 copy
  for the logits, the lookup in `dtype`); `moe_grouped_gemm` a MoE policy's expert matmuls in the
  generator (as `TrainConfig.moe_grouped_gemm`); `delay_s` emulates a slower remote engine per batch
  (benchmarks, overlap tests)."""
  engine: str = "slots"
  slots: int = 0
  chunk_steps: int = 16
  kv_block_size: int = 16
  chunks_in_flight: int = 2
  paged_attention: str = "auto"
  min_decode_width: int | None = None
  staged_slots: int = 0
  max_prompt_len: int | None = None
  recompute_kv: bool = False
  dtype: str = "float32"
  quantize: str | None = None
  moe_grouped_gemm: str = "auto"
  delay_s: float = 0.0
  RULES: ClassVar = {"engine": one_of(*GENERATOR_ENGINES), "slots": at_least(0), "chunk_steps": at_least(1),
                     "kv_block_size": at_least(1), "chunks_in_flight": at_least(1),
                     "paged_attention": one_of(*PAGED_IMPLEMENTATIONS),
                     "max_prompt_len": lambda v: None if v is None or v >= 1 else "None or >= 1",
                     "min_decode_width": lambda v: None if v is None or v >= 1 else "None or >= 1",
                     "staged_slots": at_least(0),
                     "dtype": one_of(*GENERATOR_DTYPES), "quantize": quantize_problem, "delay_s": at_least(0.0),
                     "moe_grouped_gemm": one_of("auto", *GROUPED_GEMMS)}


@dataclass(frozen=True)
class ScheduleConfig(Validated):
  """The asynchronous schedule (schedule.py): batch k trains at step k from a version at most
  `max_policy_lag` older ('fixed': exactly max(v0, k - lag), reproducible; 'latest': the newest within
  the bound). At most `buffer_capacity` scored batches wait for the trainer; the trainer waits at most
  `step_timeout_s` for one (the error then names the stalled executor)."""
  max_policy_lag: int = 1
  version_schedule: str = "fixed"
  buffer_capacity: int = 2
  step_timeout_s: float = 600.0
  RULES: ClassVar = {"max_policy_lag": at_least(0), "version_schedule": one_of(*VERSION_SCHEDULES),
                     "buffer_capacity": at_least(1), "step_timeout_s": above(0.0)}


ENVIRONMENTS = ("single_turn", "tools")
TOOL_NAMES = ("calc", "python")
MAX_TOOL_TIMEOUT_S = 300.0  # a tool call longer than this holds a rollout for too long to be a tool
STEP_MARGIN_S = 30.0  # an env.step's limit beyond its tool's: a sandboxed call's start-up and clean-up


@dataclass(frozen=True)
class EnvConfig(Validated):
  """The episode an example becomes (`llamarl_jax.envs`): 'single_turn' (one model turn, scored by the
  reward function: the default) or 'tools' (`ToolEnvironment`: a turn
  that is a tool call `name(args)` gets the tool's output appended as an observation and the model
  writes another turn).

  max_turns: model turns per episode at most (1 for single_turn). Each turn samples at most
    RolloutConfig.max_new_tokens tokens.
  max_total_tokens: the episode's response (model turns + observations) is cut at this many tokens
    (the trainer's response width); 0 = max_new_tokens x max_turns + observation room.
  max_observation_tokens: an observation's tokens are cut to this many.
  tools: the tools the environment offers ('calc': exact arithmetic through the restricted parser, in
    process; 'python': the sandbox of `llamarl_jax.tools`, one child process per call). Empty: the
    no-tool baseline (a tool call is just a wrong answer).
  tool_workers: threads running tool calls (off the generator and trainer threads).
  tool_timeout_s: wall seconds per tool call ('python': also its CPU limit), at most
    MAX_TOOL_TIMEOUT_S. A tool's timeout is an observation; an environment step still running
    `step_limit_s` (tool_timeout_s + STEP_MARGIN_S) after it started stops the run (envs/episodes.py).
  """
  name: str = "single_turn"
  max_turns: int = 1
  max_total_tokens: int = 0
  max_observation_tokens: int = 32
  tools: tuple | list = ("calc",)
  tool_workers: int = 2
  tool_timeout_s: float = 5.0
  RULES: ClassVar = {"name": one_of(*ENVIRONMENTS), "max_turns": int_at_least(1), "max_total_tokens": int_at_least(0),
                     "max_observation_tokens": int_at_least(1), "tool_workers": int_at_least(1),
                     "tool_timeout_s": between(0.0, MAX_TOOL_TIMEOUT_S, lo_open=True),
                     "tools": lambda v: (None if isinstance(v, (tuple, list)) and set(v) <= set(TOOL_NAMES)
                                         else f"a list drawn from {list(TOOL_NAMES)}")}

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "tools", tuple(self.tools))  # gin binds lists
    if self.name == "single_turn" and self.max_turns != 1:
      raise ConfigError(f"EnvConfig.max_turns={self.max_turns} needs a multi-turn environment "
                        "(EnvConfig.name='tools'); 'single_turn' has exactly one turn")

  @property
  def multi_turn(self) -> bool:
    return self.name != "single_turn"

  @property
  def step_limit_s(self) -> float:
    """Seconds an environment step may run: its tool call's limit plus the sandbox's start-up and clean-up."""
    return self.tool_timeout_s + STEP_MARGIN_S

  def response_width(self, max_new_tokens: int) -> int:
    """The episode's response width R (the trainer's): max_total_tokens, or room for every turn and
    every observation between them."""
    if not self.multi_turn:
      return max_new_tokens
    return self.max_total_tokens or (max_new_tokens * self.max_turns
                                     + self.max_observation_tokens * (self.max_turns - 1))


REWARD_MODEL_NORMALIZATIONS = ("none", "batch", "group")


@dataclass(frozen=True)
class RewardConfig(Validated):
  """`fn`: a reward name (rewards.REWARD_FNS) or a callable, scored in `workers` processes, `timeout_s`
  each. A pool the caller owns (e.g. one shared by the runs of a study) is handed to the Controller
  (`Controller(reward=...)`); `fn` then names it (`RewardExecutor.name`).

  model_path: a reward model (an HF `*ForSequenceClassification` directory, one label) that scores
    every generated row (prompt + response) in `model_dtype`, beside the rule `fn`
    (`executors.reward_model`). The reward the advantages see is then
        rule_weight * rule + model_weight * gate * normalize(model score)
    gate: 1, or with `model_gate` set, 1 only on rows whose rule reward is >= model_gate (a verifier
    gate: the model ranks only answers the verifier accepts); normalize (`model_normalize`): 'none',
    'batch' (standardised over the batch) or 'group' (over each prompt's samples). rule_weight = 0: the
    model is the only reward (the rule still reports reward/mean and reward/accuracy). None: rules only.
  """
  fn: Any = "arithmetic"
  workers: int = 2
  timeout_s: float = 5.0
  model_path: str | None = None
  model_weight: float = 1.0
  rule_weight: float = 1.0
  model_gate: float | None = None
  model_normalize: str = "none"
  model_dtype: str = "float32"
  RULES: ClassVar = {"workers": at_least(1), "timeout_s": above(0.0),
                     "model_normalize": one_of(*REWARD_MODEL_NORMALIZATIONS),
                     "model_dtype": one_of(*GENERATOR_DTYPES)}

  def __post_init__(self):
    super().__post_init__()
    if isinstance(self.fn, LiveResource):  # a running pool is not a setting
      raise ConfigError(f"RewardConfig.fn is a running {type(self.fn).__name__} ({self.fn.name!r}); pass it as "
                        f"Controller(reward=...) and set RewardConfig.fn = {self.fn.name!r}")

  @property
  def name(self) -> str:
    fn = self.fn
    return fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))


@dataclass(frozen=True)
class RunConfig(Validated):
  """Everything the Controller needs besides the model, its weights, the tokenizer and the prompts."""
  mesh: MeshConfig = field(default_factory=MeshConfig)
  rollout: RolloutConfig = field(default_factory=RolloutConfig)
  generator: GeneratorConfig = field(default_factory=GeneratorConfig)
  train: TrainConfig = field(default_factory=TrainConfig)
  schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
  reward: RewardConfig = field(default_factory=RewardConfig)
  env: EnvConfig = field(default_factory=EnvConfig)

  def __post_init__(self):
    super().__post_init__()
    if self.env.multi_turn and self.rollout.overlong.buffer_len:
      raise ConfigError(
          f"OverlongShaping.buffer_len={self.rollout.overlong.buffer_len} with EnvConfig.name={self.env.name!r}: "
          "the overlong penalty measures one response against RolloutConfig.max_new_tokens, and a multi-turn "
          "episode is several turns with observations between them; set OverlongShaping.buffer_len = 0 "
          "(OverlongShaping.mask_truncated works with episodes: it masks those the budget cut)")
    if self.mesh.reward_dp and not self.reward.model_path:
      raise ConfigError(f"MeshConfig.reward_dp={self.mesh.reward_dp} gives devices to a reward model, but "
                        "RewardConfig.model_path is None; set a reward model or MeshConfig.reward_dp = 0")
    if self.train.routing_replay and self.env.multi_turn:
      raise ConfigError(f"TrainConfig.routing_replay = True with EnvConfig.name={self.env.name!r}: a multi-turn "
                        "episode's later turns are prefilled again with observations between them, and no "
                        "routing is recorded for the episode's rows; replay routing with single-turn rollouts "
                        "(EnvConfig.name = 'single_turn') or set TrainConfig.routing_replay = False")
    problems = self.exact_logprobs_problems()
    if problems:
      raise ConfigError("RolloutConfig.exact_logprobs = True needs the generator to compute what the trainer "
                        "computes: " + "; ".join(problems) + "; or set RolloutConfig.exact_logprobs = False")
    if self.reward.model_path and self.rollout.dynamic_sampling is not None:
      raise ConfigError(f"RewardConfig.model_path={self.reward.model_path!r} with RolloutConfig.dynamic_sampling: "
                        "dynamic sampling keeps groups by the rule rewards scored in the generator loop, which "
                        "has no reward model; set RolloutConfig.dynamic_sampling = None")

  def exact_logprobs_problems(self) -> list[str]:
    """What keeps `RolloutConfig.exact_logprobs` from holding under this config (each naming its key):
    an fp8 generator, projections split over tensor or expert shards (their sums would run in
    another order), LoRA (the trainer adds adapters unmerged, the generator merges them). Empty when off."""
    if not self.rollout.exact_logprobs:
      return []
    out, m = [], self.mesh
    if self.generator.quantize is not None:
      out.append(f"GeneratorConfig.quantize={self.generator.quantize!r} (set None: fp8 weights are another policy)")
    if (m.generator_tp, m.generator_expert, m.trainer_tp, m.trainer_expert) != (1, 1, 1, 1):
      out.append(f"MeshConfig generator_tp={m.generator_tp}, generator_expert={m.generator_expert}, "
                 f"trainer_tp={m.trainer_tp}, trainer_expert={m.trainer_expert} "
                 "(set all 1: a sharded projection sums its columns' parts in another order; data "
                 "parallelism, generator_dp and trainer_fsdp, is fine: each device runs the same dots "
                 "on its rows with the whole weight)")
    if self.train.lora is not None:
      out.append("TrainConfig.lora (set None: the trainer adds the adapters unmerged, the generator merges them)")
    return out

  def check_model(self, model_config) -> None:
    """The checks that need the policy's `ModelConfig`: routing replay needs a mixture-of-experts model;
    exact log-probs need the model computed in the generator's dtype on both sides."""
    if self.rollout.exact_logprobs and model_config.dtype != self.generator.dtype:
      raise ConfigError(f"RolloutConfig.exact_logprobs = True with a model of compute dtype {model_config.dtype!r} "
                        f"and GeneratorConfig.dtype={self.generator.dtype!r}: exact log-probs need the model "
                        "computed in the generator's dtype on both sides; set ModelConfig.dtype to "
                        "GeneratorConfig.dtype, or RolloutConfig.exact_logprobs = False")
    if self.train.routing_replay and not model_config.num_experts:
      raise ConfigError(f"TrainConfig.routing_replay = True replays a mixture-of-experts policy's routing, but the "
                        f"model is dense (model_type {model_config.model_type!r}, num_experts = 0); set "
                        "TrainConfig.routing_replay = False or train a MoE model (e.g. qwen3_moe)")

  def check_layout(self, trainer_batch_divisor: int, num_processes: int) -> None:
    """The checks that need the meshes or the job: rows per step split evenly over microbatches and
    the trainer's data-parallel devices; single-process-only features."""
    rows, mb = self.rollout.rows, self.train.microbatches
    if rows % (mb * trainer_batch_divisor):
      raise ConfigError(f"RolloutConfig.prompts_per_step * samples_per_prompt = {rows} rows per step must be a "
                        f"multiple of TrainConfig.microbatches ({mb}) x trainer data*fsdp ({trainer_batch_divisor})")
    if num_processes > 1 and self.schedule.version_schedule != "fixed":
      raise ConfigError(f"ScheduleConfig.version_schedule={self.schedule.version_schedule!r} needs one process: "
                        "across processes the order of weight transfers must be a pure function of the step ('fixed')")
    if num_processes > 1 and self.train.critic is not None:
      raise ConfigError("TrainConfig.critic is single-process only (the critic needs each row's reward, which "
                        "a trainer process does not receive); set TrainConfig.critic = None across processes")
    if num_processes > 1 and self.reward.model_path and not self.mesh.reward_dp:
      raise ConfigError(f"RewardConfig.model_path={self.reward.model_path!r} with MeshConfig.reward_dp = 0 (the "
                        "generator's devices) across processes: there the reward model runs in processes of its "
                        "own; set MeshConfig.reward_dp (and reward_tp) and start the processes that own those "
                        "devices, or score with rule rewards only (RewardConfig.model_path = None)")

  def record(self) -> dict:
    """What a checkpoint records of this config (a resume compares it: checkpoint.RESUMABLE_CHANGES)."""
    r, weights = self.rollout, WeightLayout(quantize=self.generator.quantize)
    return {
        "optimizer": dataclasses.asdict(self.train.optimizer),
        "loss": {"name": self.train.loss, **self.train.loss_kwargs},
        "max_policy_lag": self.schedule.max_policy_lag, "version_schedule": self.schedule.version_schedule,
        "rollout": {"prompts_per_step": r.prompts_per_step, "samples_per_prompt": r.samples_per_prompt,
                    "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                    "max_new_tokens": r.max_new_tokens, "advantage_estimator": r.advantage_estimator,
                    "seed": r.seed, **({"exact_logprobs": True} if r.exact_logprobs else {}),
                    **({"overlong": dataclasses.asdict(r.overlong)} if r.overlong.enabled else {}),
                    **({"dynamic_sampling": dataclasses.asdict(r.dynamic_sampling)} if r.dynamic_sampling else {})},
        # the precision as the projections' and whether the lm_head is fp8 as well
        "generator": {"dtype": str(self.generator.dtype), "quantize": "fp8" if weights.fp8 else None,
                      **({"quantize_lm_head": True} if weights.fp8_lm_head else {})},
        "reward": self.reward.name,
        **({"reward_model": {k: getattr(self.reward, k) for k in ("model_path", "model_weight", "rule_weight",
                                                                  "model_gate", "model_normalize", "model_dtype")}}
           if self.reward.model_path else {}),
        "trainer": {"microbatches": self.train.microbatches, "remat": self.train.remat,
                    "group_by_length": self.train.group_by_length, "pack": self.train.pack,
                    "tokens_per_microbatch": self.train.tokens_per_microbatch,
                    **({"routing_replay": True} if self.train.routing_replay else {})},
        **({"lora": dataclasses.asdict(self.train.lora)} if self.train.lora is not None else {}),
        **({"critic": dataclasses.asdict(self.train.critic)} if self.train.critic is not None else {}),
        **({"env": dataclasses.asdict(self.env)} if self.env.multi_turn else {}),
    }


# --------------------------------------------------------------------------------------------------
# The flat keys (`run_config(max_policy_lag=2)`; a gin binding `Controller.<key>` is refused with the typed key)

SECTIONS = {"mesh": MeshConfig, "rollout": RolloutConfig, "generator": GeneratorConfig, "train": TrainConfig,
            "schedule": ScheduleConfig, "reward": RewardConfig, "env": EnvConfig}

FLAT_KEYS: dict[str, tuple[str, str]] = {
    **{k: ("mesh", k) for k in ("trainer_fsdp", "trainer_tp", "generator_dp", "generator_tp", "colocated",
                                "reward_dp", "reward_tp", "trainer_expert", "generator_expert")},
    **{k: ("rollout", k) for k in ("prompts_per_step", "samples_per_prompt", "temperature", "top_p", "top_k",
                                   "max_new_tokens", "advantage_estimator", "seed", "overlong", "dynamic_sampling",
                                   "exact_logprobs")},
    "generator_engine": ("generator", "engine"), "engine_slots": ("generator", "slots"),
    "engine_chunk_steps": ("generator", "chunk_steps"), "engine_max_prompt_len": ("generator", "max_prompt_len"),
    "engine_recompute_kv": ("generator", "recompute_kv"), "engine_kv_block_size": ("generator", "kv_block_size"),
    "engine_chunks_in_flight": ("generator", "chunks_in_flight"),
    "engine_paged_attention": ("generator", "paged_attention"),
    "engine_min_decode_width": ("generator", "min_decode_width"), "engine_staged_slots": ("generator", "staged_slots"),
    "generator_dtype": ("generator", "dtype"), "quantize": ("generator", "quantize"),
    "generator_delay_s": ("generator", "delay_s"), "generator_moe_grouped_gemm": ("generator", "moe_grouped_gemm"),
    **{k: ("train", k) for k in ("loss", "loss_kwargs", "reference_path", "optimizer", "microbatches", "remat",
                                 "checkpoint_every", "keep_checkpoints", "attention", "logprob_chunk",
                                 "group_by_length", "scan_layers", "lora", "pack", "tokens_per_microbatch",
                                 "critic", "routing_replay", "moe_grouped_gemm")},
    **{k: ("schedule", k) for k in ("max_policy_lag", "version_schedule", "buffer_capacity", "step_timeout_s")},
    "reward_fn": ("reward", "fn"), "reward_workers": ("reward", "workers"), "reward_timeout_s": ("reward", "timeout_s"),
    **{f"reward_{k}": ("reward", k) for k in ("model_path", "model_weight", "rule_weight", "model_gate",
                                              "model_normalize", "model_dtype")},
    "env_name": ("env", "name"),
    **{k: ("env", k) for k in ("max_turns", "max_total_tokens", "max_observation_tokens", "tools", "tool_workers",
                               "tool_timeout_s")},
}


def new_key(flat: str) -> str:
  """'prompts_per_step' -> 'RolloutConfig.prompts_per_step' (KeyError for an unknown key)."""
  section, name = FLAT_KEYS[flat]
  return f"{SECTIONS[section].__name__}.{name}"


def run_config(base: RunConfig | None = None, **flat) -> RunConfig:
  """A RunConfig from the flat keyword names (`max_policy_lag=2, generator_engine='static'`),
  over `base` (default: all defaults). Convenient in tests and scripts; unknown names raise."""
  unknown = sorted(k for k in flat if k not in FLAT_KEYS)
  if unknown:
    raise ConfigError(f"unknown run setting(s) {unknown}; known: {sorted(FLAT_KEYS)}")
  base = base or RunConfig()
  changes: dict[str, dict] = {}
  for key, value in flat.items():
    section, name = FLAT_KEYS[key]
    changes.setdefault(section, {})[name] = value
  return dataclasses.replace(base, **{s: dataclasses.replace(getattr(base, s), **kw) for s, kw in changes.items()})


_CONTROLLER_BINDING = re.compile(r"(?<![\w.])Controller\.(\w+)\s*=")


# Typed keys whose setting is one value of another key: a binding of one names the key that holds it.
FOLDED_KEYS = {"GeneratorConfig.quantize_lm_head": "GeneratorConfig.quantize = 'fp8+lm_head' (the fp8 lm_head is "
                                                   "one of the generator's precisions, model.config.QUANTIZATIONS)"}
_FOLDED_BINDING = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in FOLDED_KEYS) + r")\s*=")


def flat_binding_problems(text: str) -> list[str]:
  """One line per `Controller.<key> = ...` binding in gin text (a flat key), naming the typed key that holds it,
  and per binding of a `FOLDED_KEYS` key, naming the setting that holds it."""
  out = [f"{key}: use {FOLDED_KEYS[key]}" for key in dict.fromkeys(_FOLDED_BINDING.findall(text))]
  for key in dict.fromkeys(_CONTROLLER_BINDING.findall(text)):
    out.append(f"Controller.{key}: " + (f"use {new_key(key)}" if key in FLAT_KEYS
                                         else "no setting of that name (see llamarl_jax/config.py)"))
  return out
