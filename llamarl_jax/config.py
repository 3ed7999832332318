"""The run's configuration: small frozen dataclasses, each validating its own fields once.

  MeshConfig       where the trainer, the generator and a reward model run (device counts per mesh axis)
  RolloutConfig    what is sampled per step (prompts, samples, sampling parameters, advantages, seed)
  GeneratorConfig  how it is sampled (engine, slots, chunk, dtype of the generator's weights)
  TrainConfig      the objective and the optimizer (loss, its kwargs, KL reference, microbatches, remat,
                   checkpoints; a critic: CriticConfig)
  ScheduleConfig   the asynchronous part (max_policy_lag, version schedule, buffer, stall timeout)
  RewardConfig     the reward function and its worker pool; optionally a reward model combined with it
  EnvConfig        what an episode is: one turn, or turns with tool calls (llamarl_jax.envs)
  RunConfig        the seven together, with the checks that need more than one of them

Each field is checked in exactly one place: its class's `RULES` (applied by `__post_init__`, and by
`config_check` to gin bindings before anything is built, so every bad binding is reported at once).
Choice lists come from the modules that own them (losses, advantages, schedule, ...), never repeated.
No gin here: `experiment.py` registers these classes with gin (`MeshConfig.trainer_fsdp = 2`, ...).
A gin binding of a flat `Controller.<key>` gets an error naming the typed key that holds the setting
(`FLAT_KEYS`, `flat_binding_problems`); `run_config(**flat)` builds a RunConfig from the flat names.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

from llamarl_jax.advantages import ADVANTAGE_ESTIMATORS
from llamarl_jax.live import LiveResource
from llamarl_jax.model.fp8 import QUANTIZATIONS
from llamarl_jax.model.forward import ATTENTION_IMPLEMENTATIONS, DEFAULT_LOGPROB_CHUNK, REMAT_POLICIES
from llamarl_jax.model.paged_attention import PAGED_IMPLEMENTATIONS
from llamarl_jax.schedule import VERSION_SCHEDULES

Rule = Callable[[Any], "str | None"]  # a value -> None if fine, else what was expected

GENERATOR_ENGINES = ("slots", "static")
GENERATOR_DTYPES = ("float32", "bfloat16", "float16")
LR_SCHEDULES = ("constant", "cosine")


class ConfigError(ValueError):
  """A configuration value is invalid; the message names each bad field, what was expected and found."""


def at_least(lo) -> Rule:
  return lambda v: None if v >= lo else f">= {lo}"


def int_at_least(lo) -> Rule:
  return lambda v: None if isinstance(v, int) and not isinstance(v, bool) and v >= lo else f"an int >= {lo}"


def above(lo) -> Rule:
  return lambda v: None if v > lo else f"> {lo}"


def between(lo, hi, *, lo_open=False) -> Rule:
  def rule(v):
    ok = (lo < v if lo_open else lo <= v) and v <= hi
    return None if ok else f"in {'(' if lo_open else '['}{lo}, {hi}]"
  return rule


def one_of(*choices) -> Rule:
  return lambda v: None if v in choices else f"one of {list(choices)}"


def loss_names() -> tuple[str, ...]:
  from llamarl_jax import losses

  return losses.TRAINER_LOSSES


def _loss_rule(v):
  return one_of(*loss_names())(v)


class _Validated:
  """Mixin: `__post_init__` applies the class's `RULES` ({field: rule}) and raises one `ConfigError`."""

  RULES: ClassVar[dict[str, Rule]] = {}

  def __post_init__(self):
    problems = field_problems(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
    if problems:
      raise ConfigError(f"invalid {type(self).__name__}: " + "; ".join(problems))

  def replace(self, **changes):
    return dataclasses.replace(self, **changes)


def field_problems(cls, values: dict[str, Any]) -> list[str]:
  """'Class.field: expected ..., got ...' for every value of `values` that breaks `cls.RULES`."""
  out = []
  for name, value in values.items():
    rule = cls.RULES.get(name)
    if rule is None:
      continue
    try:
      why = rule(value)
    except TypeError:
      why = "a value of the annotated type"
    if why is not None:
      out.append(f"{cls.__name__}.{name}: expected {why}, got {value!r}")
  return out


@dataclass(frozen=True)
class MeshConfig(_Validated):
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
class OverlongShaping(_Validated):
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
class DynamicSampling(_Validated):
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
class RolloutConfig(_Validated):
  """Per step: `prompts_per_step` prompts x `samples_per_prompt` samples, sampled with these settings;
  advantages by `advantage_estimator` (advantages.py). `seed` fixes every batch's sampling noise.
  DAPO's `overlong` reward shaping and `dynamic_sampling` (None: off) shape what a batch holds."""
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


@dataclass(frozen=True)
class GeneratorConfig(_Validated):
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
  Both: `dtype` of the weights; `quantize` None or 'fp8' (the projections in float8_e4m3fn with
  per-output-channel scales, computed as fp8 GEMMs; the trainer quantises before the wire, or the
  generator after a LoRA merge: `model.fp8`); `quantize_lm_head` with 'fp8' the lm_head in fp8 too (a
  scale per vocabulary row; tied embeddings: an fp8 copy for the logits, the lookup in `dtype`);
  `delay_s` emulates a slower remote engine per batch (benchmarks, overlap tests)."""
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
  quantize_lm_head: bool = False
  delay_s: float = 0.0
  RULES: ClassVar = {"engine": one_of(*GENERATOR_ENGINES), "slots": at_least(0), "chunk_steps": at_least(1),
                     "kv_block_size": at_least(1), "chunks_in_flight": at_least(1),
                     "paged_attention": one_of(*PAGED_IMPLEMENTATIONS),
                     "max_prompt_len": lambda v: None if v is None or v >= 1 else "None or >= 1",
                     "min_decode_width": lambda v: None if v is None or v >= 1 else "None or >= 1",
                     "staged_slots": at_least(0),
                     "dtype": one_of(*GENERATOR_DTYPES), "quantize": lambda v: None if v in QUANTIZATIONS else (
                         "None or 'fp8' ('fp8': weights in float8_e4m3fn decoded as fp8 GEMMs, the only "
                         "quantised generator; there is no 'int8')"),
                     "delay_s": at_least(0.0)}

  def __post_init__(self):
    super().__post_init__()
    if self.quantize_lm_head and self.quantize != "fp8":
      raise ConfigError(f"GeneratorConfig.quantize_lm_head = True puts the lm_head of the fp8 generator in fp8; it "
                        f"needs GeneratorConfig.quantize = 'fp8' (got {self.quantize!r}): set quantize = 'fp8' or "
                        "quantize_lm_head = False")


@dataclass(frozen=True)
class OptimizerConfig(_Validated):
  """AdamW with linear warmup, then a constant or cosine learning rate, and global-norm clipping.

  The learning rate of update k (k = 0, 1, ...) is `lr * (k + 1) / warmup_steps` during warmup (the
  first update is not wasted at lr 0), then `lr` ("constant") or a cosine from `lr` down to
  `lr * final_lr_ratio` at `total_steps` ("cosine"; it stays there afterwards). Weight decay (decoupled)
  applies to matrices only, not to norm scales. `max_grad_norm <= 0` disables clipping.
  """
  lr: float = 1e-6
  warmup_steps: int = 0
  schedule: str = "constant"
  total_steps: int = 1000
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  max_grad_norm: float = 1.0
  final_lr_ratio: float = 0.0
  RULES: ClassVar = {"lr": at_least(0.0), "warmup_steps": at_least(0), "schedule": one_of(*LR_SCHEDULES),
                     "total_steps": at_least(1), "weight_decay": at_least(0.0), "b1": between(0.0, 1.0),
                     "b2": between(0.0, 1.0), "eps": above(0.0), "final_lr_ratio": between(0.0, 1.0)}


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the decoder's projections (model/lora.py)


@dataclass(frozen=True)
class LoraConfig(_Validated):
  """LoRA policies (`llamarl_jax.model.lora`): the base weights frozen in the generator's dtype, fp32
  adapters `a` `[in, rank]`, `b` `[rank, out]` on the `targets` projections, the update
  `alpha / rank * a @ b`; only the adapters are trained, checkpointed with their optimizer state and
  pushed to the generator (which merges them into its weights). `dropout`: LoRA dropout on the
  adapters' input in the trainer's forward (0: off). `adapter_path`: a PEFT adapter directory to start
  from (its r, lora_alpha and target_modules must be rank, alpha and targets); None: `b` = 0, the
  policy starts equal to its base."""
  rank: int = 8
  alpha: float = 16.0
  targets: tuple | list = ("q", "k", "v", "o", "gate", "up", "down")
  dropout: float = 0.0
  adapter_path: str | None = None
  RULES: ClassVar = {"rank": int_at_least(1), "alpha": above(0.0),
                     "dropout": lambda v: None if 0.0 <= v < 1.0 else "in [0, 1)",
                     "targets": lambda v: (None if isinstance(v, (tuple, list)) and v and set(v) <= set(LORA_TARGETS)
                                           and len(set(v)) == len(v)
                                           else f"a non-empty list of distinct names from {list(LORA_TARGETS)}")}

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "targets", tuple(self.targets))  # gin binds lists


@dataclass(frozen=True)
class CriticConfig(_Validated):
  """PPO with a critic (`llamarl_jax.train.critic`): a value model trained beside the policy on the
  trainer's mesh, and token-level GAE advantages from its values in place of the rollout's per-row
  advantages (`RolloutConfig.advantage_estimator` is then unused); every `TrainConfig.loss` takes them.

  path: an HF `*ForSequenceClassification` directory (one label) to start the critic from; None: the
    policy's weights (after a warm start: the warm-started policy) with a fresh zero score head.
  optimizer: the critic's own AdamW (its own learning rate and schedule).
  value_clip: PPO's value clipping: each update's values stay within value_clip of the values the
    returns were computed from (`losses.value_loss`); None: unclipped. It binds from the second of
    `updates_per_step` updates on (the first starts at those values).
  updates_per_step: critic updates on each batch (full batch each, gradient accumulation over
    `TrainConfig.microbatches`).
  warmup_steps: the first steps train the critic only; the policy keeps its weights (its version still
    advances with the step, so the schedule and checkpoints are unchanged).
  gamma, lam: GAE's discount and trace decay (`advantages.gae`); the outcome reward sits at each
    response's last token.
  whiten: advantages standardised over the batch's valid tokens (mean 0, std 1, as verl does).
  Values come from the critic of the step that trains a row, also for rows generated by an older
  policy under the lag bound (see `train.critic`)."""
  path: str | None = None
  optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
  value_clip: float | None = 0.5
  updates_per_step: int = 1
  warmup_steps: int = 0
  gamma: float = 1.0
  lam: float = 0.95
  whiten: bool = True
  RULES: ClassVar = {"value_clip": lambda v: None if v is None or v > 0 else "None or > 0",
                     "updates_per_step": int_at_least(1), "warmup_steps": int_at_least(0),
                     "gamma": between(0.0, 1.0), "lam": between(0.0, 1.0), "whiten": one_of(False, True)}


@dataclass(frozen=True)
class TrainConfig(_Validated):
  """The trainer: `loss` (a name in losses.TRAINER_LOSSES) with `loss_kwargs`; a KL reference (`reference_path`,
  an HF directory; None = the policy RL starts from) when loss_kwargs has `kl_coef`; the optimizer;
  `microbatches` per step (gradient accumulation), `remat` ('none' | 'matmuls': save matmul outputs |
  'full'; True = 'full'); a checkpoint every `checkpoint_every` steps (0: only at exit), the newest
  `keep_checkpoints` kept. `attention`: the trainer's kernel ('auto': cuDNN fused attention on a GPU
  in bf16/fp16, XLA elsewhere; 'cudnn' where it cannot run is an error at start; 'xla');
  `logprob_chunk`: positions per chunk of the lm_head + log-prob (None: unchunked). `group_by_length`:
  sort each step's rows by length into its microbatches, each run at the width of its longest row
  (on a ladder of 4 widths an octave: one compiled program per width seen), instead of every
  microbatch at the batch's full width; the same loss and gradient, far less padding on long-tailed
  batches when microbatches hold few rows (16 microbatches of 64 long-tail rows: 25% padded tokens
  instead of 611%). Off by default: a step is then one fused program, and short or equal-length
  batches gain nothing. `scan_layers`: the layers under one `lax.scan` (compile time flat in depth);
  False unrolls them (faster steps for small models on a CPU: the tiny configs). `lora`: a
  `LoraConfig` trains LoRA adapters on a frozen base instead of every weight (None: full fine-tuning).
  `critic`: a `CriticConfig` turns on PPO with a value model (None: critic-free advantages).
  `pack`: pack each step's rows end to end into rows of `tokens_per_microbatch` tokens (at least the
  batch's prompt + response width), attention kept within each sequence; a microbatch is one packed
  row per data-parallel shard, as many as the packing needs: the same loss and gradient, computed
  tokens close to the real ones whatever the length mix, and one compiled step program (`microbatches`
  stays 1, `group_by_length` off). `routing_replay`: a mixture-of-experts policy's forward in the
  trainer uses the experts the generator recorded for each token (`RolloutBatch.routing`) instead of
  its own top-k, its router still trained through their probabilities (`model.moe`); the share of
  tokens routed differently is logged either way (`moe/routing_disagreement`). Needs a MoE model,
  single-turn rollouts (the generators record routing per turn) and the padded or length-grouped
  layout (pack = False)."""
  loss: str = "aipo"
  loss_kwargs: dict = field(default_factory=dict)
  reference_path: str | None = None
  optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
  microbatches: int = 1
  remat: bool | str = False
  checkpoint_every: int = 0
  keep_checkpoints: int = 2
  attention: str = "auto"
  logprob_chunk: int | None = DEFAULT_LOGPROB_CHUNK
  group_by_length: bool = False
  scan_layers: bool = True
  lora: LoraConfig | None = None
  pack: bool = False
  tokens_per_microbatch: int | None = None
  critic: CriticConfig | None = None
  routing_replay: bool = False
  RULES: ClassVar = {"loss": _loss_rule, "microbatches": at_least(1), "checkpoint_every": at_least(0),
                     "keep_checkpoints": at_least(1),
                     "remat": one_of(False, True, *REMAT_POLICIES), "attention": one_of(*ATTENTION_IMPLEMENTATIONS),
                     "logprob_chunk": lambda v: None if v is None or v >= 1 else "None or >= 1",
                     "group_by_length": one_of(False, True), "scan_layers": one_of(False, True),
                     "pack": one_of(False, True), "routing_replay": one_of(False, True),
                     "tokens_per_microbatch": lambda v: None if v is None or v >= 1 else "None or >= 1"}

  def __post_init__(self):
    super().__post_init__()
    if self.pack and (not self.tokens_per_microbatch or self.microbatches != 1 or self.group_by_length):
      raise ConfigError(f"TrainConfig.pack = True needs tokens_per_microbatch (a packed row's tokens, at least the "
                        f"prompt + response width; got {self.tokens_per_microbatch}), microbatches = 1 (got "
                        f"{self.microbatches}: the packing sets them) and group_by_length = False (got "
                        f"{self.group_by_length})")
    if self.critic is not None and self.pack:
      raise ConfigError("TrainConfig.critic with TrainConfig.pack = True: the critic trains on the padded or "
                        "length-grouped layout; set TrainConfig.pack = False")
    if self.routing_replay and self.pack:
      raise ConfigError("TrainConfig.routing_replay = True with TrainConfig.pack = True: the packed step does not "
                        "replay routing; set TrainConfig.pack = False (the padded or length-grouped layout replays)")
    problems = loss_kwargs_problems(self.loss, self.loss_kwargs)
    if problems:
      raise ConfigError(f"invalid TrainConfig.loss_kwargs: {problems}")


def loss_kwargs_problems(loss: str, kwargs: Any) -> str | None:
  """Keys of `loss_kwargs` must be parameters of the chosen loss (a typo would only fail at trace)."""
  import inspect

  from llamarl_jax import losses

  if not isinstance(kwargs, dict) or loss not in losses.TRAINER_LOSSES:
    return None
  params = set(inspect.signature(losses.get_loss(loss)).parameters)
  reserved = {"logprobs", "behaviour_logprobs", "advantages", "mask", "ref_logprobs", "entropy"}
  bad = sorted(k for k in kwargs if k not in params or k in reserved)
  return None if not bad else (f"keyword arguments of the {loss!r} loss ({sorted(params - reserved)}); "
                               f"unknown: {bad}")


@dataclass(frozen=True)
class ScheduleConfig(_Validated):
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
class EnvConfig(_Validated):
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
class RewardConfig(_Validated):
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
class RunConfig(_Validated):
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
    if self.reward.model_path and self.rollout.dynamic_sampling is not None:
      raise ConfigError(f"RewardConfig.model_path={self.reward.model_path!r} with RolloutConfig.dynamic_sampling: "
                        "dynamic sampling keeps groups by the rule rewards scored in the generator loop, which "
                        "has no reward model; set RolloutConfig.dynamic_sampling = None")

  def check_model(self, model_config) -> None:
    """The checks that need the policy's `ModelConfig`: routing replay needs a mixture-of-experts model."""
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
    r, g = self.rollout, self.generator
    return {
        "optimizer": dataclasses.asdict(self.train.optimizer),
        "loss": {"name": self.train.loss, **self.train.loss_kwargs},
        "max_policy_lag": self.schedule.max_policy_lag, "version_schedule": self.schedule.version_schedule,
        "rollout": {"prompts_per_step": r.prompts_per_step, "samples_per_prompt": r.samples_per_prompt,
                    "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
                    "max_new_tokens": r.max_new_tokens, "advantage_estimator": r.advantage_estimator,
                    "seed": r.seed,
                    **({"overlong": dataclasses.asdict(r.overlong)} if r.overlong.enabled else {}),
                    **({"dynamic_sampling": dataclasses.asdict(r.dynamic_sampling)} if r.dynamic_sampling else {})},
        "generator": {"dtype": str(g.dtype), "quantize": g.quantize,
                      **({"quantize_lm_head": True} if g.quantize_lm_head else {})},
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
                                   "max_new_tokens", "advantage_estimator", "seed", "overlong", "dynamic_sampling")},
    "generator_engine": ("generator", "engine"), "engine_slots": ("generator", "slots"),
    "engine_chunk_steps": ("generator", "chunk_steps"), "engine_max_prompt_len": ("generator", "max_prompt_len"),
    "engine_recompute_kv": ("generator", "recompute_kv"), "engine_kv_block_size": ("generator", "kv_block_size"),
    "engine_chunks_in_flight": ("generator", "chunks_in_flight"),
    "engine_paged_attention": ("generator", "paged_attention"),
    "engine_min_decode_width": ("generator", "min_decode_width"), "engine_staged_slots": ("generator", "staged_slots"),
    "generator_dtype": ("generator", "dtype"), "quantize": ("generator", "quantize"),
    "quantize_lm_head": ("generator", "quantize_lm_head"),
    "generator_delay_s": ("generator", "delay_s"),
    **{k: ("train", k) for k in ("loss", "loss_kwargs", "reference_path", "optimizer", "microbatches", "remat",
                                 "checkpoint_every", "keep_checkpoints", "attention", "logprob_chunk",
                                 "group_by_length", "scan_layers", "lora", "pack", "tokens_per_microbatch",
                                 "critic", "routing_replay")},
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


def flat_binding_problems(text: str) -> list[str]:
  """One line per `Controller.<key> = ...` binding in gin text (a flat key), naming the typed key that holds it."""
  out = []
  for key in dict.fromkeys(_CONTROLLER_BINDING.findall(text)):
    out.append(f"Controller.{key}: " + (f"use {new_key(key)}" if key in FLAT_KEYS
                                         else "no setting of that name (see llamarl_jax/config.py)"))
  return out
