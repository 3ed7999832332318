"""The trainer's configuration: `TrainConfig` and its parts, small frozen dataclasses validated once.

  OptimizerConfig  AdamW, its learning-rate schedule and clipping (the policy's; a critic has its own)
  LoraConfig       LoRA adapters on a frozen base
  CriticConfig     PPO's value model and GAE
  TrainLayout      how a step's rows go through the trainer (padded | grouped | packed), one value with
                   its rules in `TrainLayout.check`
  TrainConfig      the objective, the optimizer, microbatches, remat, checkpoints, the layout's keys

Part of `RunConfig` (`llamarl_jax.config`, which re-exports these names); the fields' rules come from
`field_rules`, as every section's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

from llamarl_jax.field_rules import ConfigError, Validated, above, at_least, between, int_at_least, one_of
from llamarl_jax.model.config import GROUPED_GEMMS
from llamarl_jax.model.forward import ATTENTION_IMPLEMENTATIONS, DEFAULT_LOGPROB_CHUNK, REMAT_POLICIES

LR_SCHEDULES = ("constant", "cosine")


def loss_names() -> tuple[str, ...]:
  from llamarl_jax import losses

  return losses.TRAINER_LOSSES


def _loss_rule(v):
  return one_of(*loss_names())(v)


@dataclass(frozen=True)
class OptimizerConfig(Validated):
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


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down",  # the decoder's projections (model/lora.py)
                "expert_gate", "expert_up", "expert_down")  # every expert's of a MoE layer (one adapter each)
EXPERT_LORA_TARGETS = ("expert_gate", "expert_up", "expert_down")


@dataclass(frozen=True)
class LoraConfig(Validated):
  """LoRA policies (`llamarl_jax.model.lora`): the base weights frozen in the generator's dtype, fp32
  adapters `a` `[in, rank]`, `b` `[rank, out]` on the `targets` projections, the update
  `alpha / rank * a @ b`; only the adapters are trained, checkpointed with their optimizer state and
  pushed to the generator (which merges them into its weights). `dropout`: LoRA dropout on the
  adapters' input in the trainer's forward (0: off). `adapter_path`: a PEFT adapter directory to start
  from (its r, lora_alpha and target_modules must be rank, alpha and targets); None: `b` = 0, the
  policy starts equal to its base. On a MoE model (`qwen3_moe`) 'gate', 'up', 'down' name a dense
  layer's MLP and 'expert_gate', 'expert_up', 'expert_down' every expert's projections of a sparse layer
  (per-expert `a` `[experts, in, rank]`, `b` `[experts, rank, out]`); expert adapters take no dropout."""
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
    experts = [t for t in self.targets if t in EXPERT_LORA_TARGETS]
    if experts and self.dropout > 0:
      raise ConfigError(f"invalid LoraConfig: dropout={self.dropout} with expert targets {experts}: LoRA dropout "
                        "is applied to dense projections only; set dropout = 0.0 or drop the expert targets")


@dataclass(frozen=True)
class CriticConfig(Validated):
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


TRAIN_LAYOUTS = ("padded", "grouped", "packed")


@dataclass(frozen=True)
class TrainLayout:
  """How a step's rows go through the trainer (`train.programs`), one value (`TrainConfig.layout`,
  resolved once from its `group_by_length`, `pack` and `tokens_per_microbatch`):
    padded   every microbatch at the batch's full width P + R, one fused program (the default);
    grouped  rows sorted by length into the microbatches, each run at its longest row's width;
    packed   rows end to end into rows of `tokens` tokens (segment ids), a microbatch per packed row
             and data-parallel shard, one program whatever the lengths.
  The three give the same loss and gradient. `check` holds every rule of the layout."""
  kind: str = "padded"
  tokens: int | None = None  # packed: a packed row's tokens, at least the batch's P + R

  def __post_init__(self):
    self.check()

  @property
  def grouped(self) -> bool:
    return self.kind == "grouped"

  @property
  def packed(self) -> bool:
    return self.kind == "packed"

  def check(self, *, microbatches: int = 1, critic: bool = False, routing_replay: bool = False,
            group_by_length: bool = False) -> TrainLayout:
    """This layout, or one `ConfigError` naming the keys of every rule it breaks with the trainer's
    other settings (the only place these rules are written; `TrainConfig` and `TrainerExecutor` apply
    it): a kind of `TRAIN_LAYOUTS`; a token budget for the packed layout only; packed: microbatches =
    1 (the packing makes them), not grouped by length as well, no critic and no routing replay (both
    run on the padded or grouped layout). group_by_length: `TrainConfig`'s key beside `pack`."""
    problems = []
    if self.kind not in TRAIN_LAYOUTS:
      problems.append(f"TrainLayout.kind: expected one of {list(TRAIN_LAYOUTS)}, got {self.kind!r}")
    tokens_ok = isinstance(self.tokens, int) and not isinstance(self.tokens, bool) and self.tokens >= 1
    if self.packed and not tokens_ok:
      problems.append(f"TrainConfig.pack = True needs TrainConfig.tokens_per_microbatch, a packed row's tokens (an "
                      f"int >= 1, at least the prompt + response width; got {self.tokens!r})")
    if not self.packed and self.tokens is not None:
      problems.append(f"TrainLayout.tokens = {self.tokens!r} is the packed layout's token budget; the {self.kind!r} "
                      "layout has none (tokens = None)")
    if self.packed and microbatches != 1:
      problems.append(f"TrainConfig.pack = True needs TrainConfig.microbatches = 1 (got {microbatches}): the packing "
                      "makes the microbatches")
    if self.packed and group_by_length:
      problems.append("TrainConfig.pack = True with TrainConfig.group_by_length = True: a packed step is not grouped "
                      "by length; set one of them")
    if self.packed and critic:
      problems.append("TrainConfig.critic with TrainConfig.pack = True: the critic trains on the padded or "
                      "length-grouped layout; set TrainConfig.pack = False")
    if self.packed and routing_replay:
      problems.append("TrainConfig.routing_replay = True with TrainConfig.pack = True: the packed step does not "
                      "replay routing; set TrainConfig.pack = False (the padded or length-grouped layout replays)")
    if problems:
      raise ConfigError(f"invalid training layout {self.kind!r}: " + "; ".join(problems))
    return self


@dataclass(frozen=True)
class TrainConfig(Validated):
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
  layout (pack = False). `moe_grouped_gemm`: a MoE policy's expert matmuls in the trainer
  (`model.config.GROUPED_GEMMS`; 'auto': the Pallas tile kernels on a GPU once `gpu_paths` records
  them as passed there, `jax.lax.ragged_dot` elsewhere; 'pallas' is opt-in on a GPU, interpret mode on
  a CPU). `layout`: these keys resolved into one `TrainLayout`, what the trainer takes."""
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
  moe_grouped_gemm: str = "auto"
  RULES: ClassVar = {"loss": _loss_rule, "microbatches": at_least(1), "checkpoint_every": at_least(0),
                     "keep_checkpoints": at_least(1),
                     "remat": one_of(False, True, *REMAT_POLICIES), "attention": one_of(*ATTENTION_IMPLEMENTATIONS),
                     "logprob_chunk": lambda v: None if v is None or v >= 1 else "None or >= 1",
                     "group_by_length": one_of(False, True), "scan_layers": one_of(False, True),
                     "pack": one_of(False, True), "routing_replay": one_of(False, True),
                     "moe_grouped_gemm": one_of("auto", *GROUPED_GEMMS),
                     "tokens_per_microbatch": lambda v: None if v is None or v >= 1 else "None or >= 1"}

  def __post_init__(self):
    super().__post_init__()
    self.layout  # resolved and checked once, here
    problems = loss_kwargs_problems(self.loss, self.loss_kwargs)
    if problems:
      raise ConfigError(f"invalid TrainConfig.loss_kwargs: {problems}")

  @functools.cached_property
  def layout(self) -> TrainLayout:
    """`group_by_length`, `pack` and `tokens_per_microbatch` as one `TrainLayout`, checked against the
    other settings (`TrainLayout.check`); resolved once, at construction."""
    kind = "packed" if self.pack else "grouped" if self.group_by_length else "padded"
    return TrainLayout(kind, self.tokens_per_microbatch if self.pack else None).check(
        microbatches=self.microbatches, critic=self.critic is not None, routing_replay=self.routing_replay,
        group_by_length=self.group_by_length)


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
