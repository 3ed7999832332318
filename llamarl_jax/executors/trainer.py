"""The trainer executor: one jitted, sharded policy-gradient step per scored batch (LlamaRL's trainer).

`TrainerExecutor.step(batch)` runs on the trainer mesh:

  host:   the `ScoredBatch` (numpy, fixed shapes [B, P] / [B, R]) is cast to fixed dtypes and put on
          the mesh with the batch sharding (rows over `data` x `fsdp`).
  device: one jitted call (params and optimizer state donated, explicit in/out shardings): the
          params are cast to the compute dtype with the layers stacked (`prepare_params`), once per
          step; then a `lax.scan` over `microbatches` slices of the batch, each a forward over the
          rows of `trainer_layout` (prompt + response from position 0, right-padded; the layers
          under `lax.scan`, causal attention with per-row lengths: cuDNN's fused kernel on a GPU),
          response-token log-probs with the lm_head in chunks of `logprob_chunk` positions (no
          [B, R, V] logits), the chosen loss (`LOSSES`, AIPO by default) and its gradient w.r.t. the
          compute copy, accumulated in fp32 on the parameter shardings (reduce-scatter under FSDP);
          then global-norm clipping and AdamW on the fp32 masters. A non-finite loss or gradient
          norm keeps the old params and optimizer state (an elementwise select) and bumps
          `train/skipped_nonfinite`.
          The step's log pi against the batch's log mu gives the trainer-generator mismatch metrics
          (`rollout_corr/*`, `llamarl_jax.mismatch`), split by the tokens' policy lag.

Microbatching is exact, not an approximation: the loss of a microbatch is weighted by its share of
the batch's normaliser (valid tokens for `token_mean`, valid sequences for `seq_mean_token_mean`,
rows for the fixed-normaliser modes), so the summed gradient equals the full-batch gradient.

Grouping by length (`group_by_length=True`): the host reads the rows' lengths (one `[B]` int32
transfer), sorts the rows (longest first, ties by index: `group_by_length`) and cuts them into the
same `microbatches` slices of B/M rows, so the long rows share a microbatch and the short ones
another. Each microbatch then runs at its own width (its longest row, rounded up to a rung of
`width_bucket`: 4 per octave) as its own call of a jitted gradient-accumulation program, one
compiled program per width used; a prepare program (params cast, rows permuted, normalisers of the
whole batch) runs before and an apply program (clip, AdamW, metrics) after. The shares, hence the
loss and the gradient, are the ungrouped step's (up to fp32 summation order); the memory of a
microbatch never exceeds the ungrouped one's. `train/padding_fraction` reports the padding computed.

Params are fp32 masters, sharded by `parallel.RULES` (FSDP over `fsdp`; TP over `tp` when the mesh
has tp > 1). `config.dtype` is the compute dtype: 'bfloat16' gives bf16 compute with fp32 master
weights and fp32 logits/log-probs. `remat` chooses what the backward recomputes: 'none', 'matmuls'
(matmul outputs saved), 'full' (only each layer's input saved).

LoRA (`lora=LoraConfig`): the trained params are the adapters (`model.lora`), fp32, sharded like
the matrices they adapt; the base is frozen in `base_dtype` and prepared (cast, stacked) each step
beside them, outside the differentiated arguments: no fp32 copy, gradient or optimizer state of a
base weight exists. The forward adds `alpha / rank * (x @ a) @ b` to each adapted projection
(`llama.with_lora`), under the same scan, remat, attention kernels, chunked log-probs, microbatches
and length grouping as full fine-tuning. LoRA dropout (`LoraConfig.dropout` > 0) masks the input of
each adapted projection's `a` with a key from (`lora_seed`, step, microbatch), so a resumed run draws
the same masks; the step's log pi (its loss and mismatch metrics) is then the dropped-out policy's.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llamarl_jax import losses, mismatch, parallel
from llamarl_jax.config import LoraConfig, OptimizerConfig
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.generation.rollout import TRAIN_FIELDS, ScoredBatch, trainer_layout
from llamarl_jax.model.llama import (DEFAULT_LOGPROB_CHUNK, Llama, ModelConfig, chunked_token_logprobs,
                                     lm_head_weight, merge_params, prepare_params, remat_policy,
                                     resolve_attention, scan_hidden_states, split_params, unstack_layers)

Array = jax.Array


# --------------------------------------------------------------------------------------------------
# optimizer


def lr_schedule(cfg: OptimizerConfig) -> optax.Schedule:
  """Learning rate as a function of the number of updates already applied (see `OptimizerConfig`)."""

  def schedule(count):
    count = jnp.asarray(count, jnp.float32)
    warm = jnp.minimum(1.0, (count + 1.0) / max(cfg.warmup_steps, 1))
    if cfg.schedule == "constant":
      return cfg.lr * warm
    decay_steps = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = jnp.clip((count - cfg.warmup_steps) / decay_steps, 0.0, 1.0)
    cosine = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    decayed = cfg.lr * (cfg.final_lr_ratio + (1.0 - cfg.final_lr_ratio) * cosine)
    return jnp.where(count < cfg.warmup_steps, cfg.lr * warm, decayed)

  return schedule


def _decay_mask(params):
  """Weight decay on matrices (ndim >= 2), not on vectors (RMSNorm scales)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  """clip_by_global_norm -> AdamW(lr_schedule(cfg)), decay masked to matrices."""
  adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=_decay_mask)
  if cfg.max_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
  return adamw


def _applied_updates(opt_state) -> Array:
  """The schedule's count (updates applied so far) inside an optax state built by `make_optimizer`."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
  if len(found) != 1:
    raise ValueError(f"expected one ScaleByScheduleState in the optimizer state, found {len(found)}")
  return found[0].count


# --------------------------------------------------------------------------------------------------
# log-probs


def token_logprobs(graphdef, params, prompt_tokens, prompt_mask, response_tokens, response_mask, *,
                   temperature: float = 1.0, remat="none", with_entropy: bool = False,
                   attention: str = "xla", logprob_chunk: int | None = None, scan_layers: bool = True):
  """Log-probs `[B, R]` (fp32) of the response tokens under the policy at `temperature`.

  params: the model's `split_params` dict (any dtype; cast to the compute dtype here). See
  `policy_logprobs` for the computation. With `with_entropy=True` also returns the entropy `[B, R]`
  of the tempered next-token distribution (0 where masked).
  """
  config = merge_params(graphdef, params).config
  prepared = prepare_params(params, config.dtype)
  return policy_logprobs(config, prepared, prompt_tokens, prompt_mask, response_tokens, response_mask,
                         temperature=temperature, remat=remat, with_entropy=with_entropy,
                         attention=attention, logprob_chunk=logprob_chunk, scan_layers=scan_layers)


def policy_logprobs(config: ModelConfig, prepared, prompt_tokens, prompt_mask, response_tokens,
                    response_mask, *, temperature: float = 1.0, remat="none", with_entropy: bool = False,
                    attention: str = "xla", logprob_chunk: int | None = None, width: int | None = None,
                    scan_layers: bool = True, lora: dict | None = None, lora_scale: float = 1.0,
                    lora_dropout: float = 0.0, dropout_key: Array | None = None):
  """`token_logprobs` on params already prepared (`prepare_params`: cast, layers stacked).

  One forward over the rows of `trainer_layout` (real prompt tokens from position 0, then the
  response, right-padded) with the layers under scan (`scan_hidden_states`); the hidden states that
  predict response tokens (`predict` `[B, R]`) are gathered *before* the vocabulary projection, which
  then runs `logprob_chunk` positions at a time (`chunked_token_logprobs`: no `[B, R, V]` array when
  the chunk is smaller than R). Positions where `response_mask` is 0 are 0.

  width: the forward's sequence length, at most P + R (default: P + R). Every row must fit (prompt +
  response up to its last valid token <= width, as `group_by_length` guarantees): positions past it
  are padding and are cut off. scan_layers, lora (prepared adapters), lora_scale, lora_dropout,
  dropout_key: see `scan_hidden_states`.
  """
  tokens, lengths, predict = trainer_layout(prompt_tokens, prompt_mask, response_tokens, response_mask)
  if width is not None:
    tokens = tokens[:, :width]
    predict = jnp.minimum(predict, width - 1)  # only masked response positions point past the width
  hidden = scan_hidden_states(config, prepared, tokens, lengths, attention=attention, remat=remat,
                              scan_layers=scan_layers, lora=lora, lora_scale=lora_scale,
                              lora_dropout=lora_dropout, dropout_key=dropout_key)
  hidden = jnp.take_along_axis(hidden, predict[..., None], axis=1)  # [B, R, E]
  logprobs, entropy = chunked_token_logprobs(hidden, lm_head_weight(config, prepared), response_tokens,
                                             temperature=temperature, chunk=logprob_chunk,
                                             with_entropy=with_entropy)
  valid = response_mask.astype(bool)
  logprobs = jnp.where(valid, logprobs, 0.0)
  if not with_entropy:
    return logprobs
  return logprobs, jnp.where(valid, entropy, 0.0)


# --------------------------------------------------------------------------------------------------
# grouping rows by length

MIN_WIDTH = 16  # the narrowest microbatch width: below it a narrower program saves nothing worth a compile


def width_bucket(length: int, max_width: int) -> int:
  """The sequence width of a microbatch whose longest row has `length` tokens: the smallest rung of
  16, 20, 24, 28, 32, 40, 48, 56, 64, 80, ... (m * 2^e, m in 4..7: 4 rungs an octave) that holds it,
  capped at `max_width` (P + R, the ungrouped width). A rung wastes under 25% of a row (about 10% on
  average), and a run compiles at most one microbatch program per rung: at most 4 log2(max_width / 16) + 2."""
  length = max(int(length), MIN_WIDTH)
  step = 1 << (length.bit_length() - 3)  # 2^e with 4 <= length / 2^e < 8
  return min(-(-length // step) * step, int(max_width))


@dataclasses.dataclass(frozen=True)
class LengthGroups:
  """A step's microbatches grouped by length (`group_by_length`).

  order: `[B]` int32, the batch row at each position of the grouped batch (microbatch m holds the
  positions j * M + m, as the trainer's microbatch split takes them). widths: each microbatch's
  sequence width, M ints. padding_fraction: padded positions of the grouped microbatches per real
  token, (B / M * sum(widths) - sum(lengths)) / sum(lengths)."""
  order: np.ndarray
  widths: tuple[int, ...]
  padding_fraction: float


def group_by_length(lengths: np.ndarray, microbatches: int, max_width: int) -> LengthGroups:
  """Sort rows by length and cut them into `microbatches` groups of B/M rows, each as wide as its
  longest row (`width_bucket`).

  lengths: `[B]` ints, each trainer row's prompt + response length (`trainer_layout`). Rows are
  ordered longest first, ties by row index: a deterministic function of the lengths (every process
  computes the same grouping). Consecutive groups of the sorted rows minimise the padded positions
  among all splits into groups of B/M rows; microbatch m holds sorted rows m*B/M .. (m+1)*B/M - 1 at
  positions j*M + m, so that each data-parallel device keeps B/M / (data*fsdp) rows of every
  microbatch, as in the ungrouped split.
  """
  lengths = np.asarray(lengths, np.int64)
  B, M = len(lengths), microbatches
  if B % M:
    raise ValueError(f"{B} rows do not split into {M} microbatches of equal size")
  groups = np.argsort(-lengths, kind="stable").reshape(M, B // M)  # [M, B/M] row indices
  widths = tuple(width_bucket(lengths[g].max(), max_width) for g in groups)
  real = int(lengths.sum())
  return LengthGroups(order=groups.T.reshape(B).astype(np.int32), widths=widths,
                      padding_fraction=(B // M * sum(widths) - real) / max(real, 1))


# --------------------------------------------------------------------------------------------------
# the executor

_BATCH_DTYPES = TRAIN_FIELDS  # rollout.py: the one batch schema of training


def run_trainer_options(run) -> dict:
  """The `TrainerExecutor` keyword settings a `RunConfig` sets (the Controller's trainer and the memory
  plan's abstract one are built from the same)."""
  t, r = run.train, run.rollout
  return dict(optimizer=t.optimizer, loss=t.loss, loss_kwargs=t.loss_kwargs, microbatches=t.microbatches,
              remat=t.remat, attention=t.attention, logprob_chunk=t.logprob_chunk,
              group_by_length=t.group_by_length, scan_layers=t.scan_layers,
              temperature=max(r.temperature, 1e-6) if r.temperature > 0 else 1.0,
              reference_is_initial=t.reference_path is None, lora=t.lora, base_dtype=run.generator.dtype)


class TrainerExecutor:
  """Holds the policy's fp32 params and optimizer state on the trainer mesh; `step` trains one batch.

  config: the model architecture (its `dtype` is the compute dtype). mesh: the trainer mesh
  `(data, fsdp, tp)`. params: initial params (nested dict as from `split_params`; host or device,
  any dtype; copied, cast to fp32 and sharded). loss: a name in `losses.TRAINER_LOSSES`; loss_kwargs go to it
  (e.g. `rho_max`). microbatches: gradient-accumulation slices of the batch (B must be a multiple of
  `microbatches * data * fsdp`). group_by_length: sort the rows into the microbatches by length and run
  each at its own width (see the module docstring); off: one fused program per step, every
  microbatch at the batch's full width. ref_params: optional frozen reference policy for a KL penalty
  (`kl_coef`), kept in the compute dtype on the same mesh, and checkpointed with the state.
  reference_is_initial: the reference is "the policy training starts from": `load_params` (e.g. after
  a supervised warm start) replaces it too.

  lora: a `LoraConfig`: `params` become the frozen base, held in `base_dtype` (the generator's: no
  fp32 copy, no optimizer state), and what is trained is LoRA adapters (`model.lora`; `adapters`, a
  tree of `lora.adapter_shapes`, or initialised from `lora_seed` with `b` = 0). The optimizer, the
  gradient clipping and the loss's gradient see only the adapters (fp32, sharded like the matrices
  they adapt); the forward adds them unmerged (`llama.with_lora`).

  `params` returns the live arrays of what is trained (the fp32 masters, or the adapters): the next
  `step` donates them, so copy what you keep. `policy_params()` is the whole policy.
  """

  def __init__(self, config: ModelConfig, mesh: Mesh, params: Any, *,
               optimizer: OptimizerConfig | None = None, loss: str = "aipo",
               loss_kwargs: Mapping[str, Any] | None = None, microbatches: int = 1, remat: bool | str = False,
               temperature: float = 1.0, ref_params: Any = None, kl_coef: float = 0.0,
               reference_is_initial: bool = False, attention: str = "auto",
               logprob_chunk: int | None = DEFAULT_LOGPROB_CHUNK, platform: str | None = None,
               group_by_length: bool = False, scan_layers: bool = True,
               rules: Mapping[str, str | None] = parallel.RULES, lora: LoraConfig | None = None,
               base_dtype="float32", adapters: Any = None, lora_seed: int = 0):
    if microbatches < 1:
      raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if temperature <= 0:
      raise ValueError(f"temperature must be > 0 (the sampling temperature; use 1.0 for greedy), "
                       f"got {temperature}")
    if (kl_coef or (loss_kwargs or {}).get("kl_coef")) and ref_params is None:
      raise ValueError("a KL penalty (kl_coef > 0) needs ref_params, the reference policy's params")
    self.config = config
    self.mesh = mesh
    self.optimizer_config = optimizer or OptimizerConfig()
    self.loss_name = loss
    self.loss_fn = losses.get_loss(loss, trainer=True)
    self.loss_kwargs = dict(loss_kwargs or {})
    for reserved in ("ref_logprobs", "entropy"):
      if reserved in self.loss_kwargs:
        raise ValueError(f"loss_kwargs must not contain {reserved!r}: the trainer computes it")
    if kl_coef:
      if self.loss_kwargs.get("kl_coef", kl_coef) != kl_coef:
        raise ValueError(f"kl_coef given twice: {kl_coef} and loss_kwargs {self.loss_kwargs['kl_coef']}")
      self.loss_kwargs["kl_coef"] = kl_coef
    self._with_entropy = bool(self.loss_kwargs.get("entropy_coef", 0.0))
    if logprob_chunk is not None and logprob_chunk < 1:
      raise ValueError(f"logprob_chunk must be a positive number of positions (or None: unchunked), got "
                       f"{logprob_chunk}")
    self.microbatches = microbatches
    self.group_by_length = bool(group_by_length)
    self.remat = remat_policy(remat)
    self.logprob_chunk = logprob_chunk
    self.scan_layers = bool(scan_layers)
    # The platform the step is compiled for: the mesh's, or another one to lower for (`lower_step`).
    self.platform = platform or mesh.devices.flat[0].platform
    self.attention = resolve_attention(attention, self.platform, config.dtype)
    self.reference_is_initial = reference_is_initial
    self.temperature = float(temperature)
    self.busy_seconds = 0.0
    # times a train-step program was traced (= compiled): 1 for the fused step; grouped by length, 1
    # each for the lengths, prepare and apply programs and 1 per microbatch width used
    self.trace_count = 0

    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    self.graphdef, model_shapes = split_params(abstract)
    self.model_axes = parallel.logical_axes(abstract)
    model_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), model_shapes)
    # the whole model's shardings (the params, the LoRA base, the KL reference) and the trained params'
    self.model_shardings = parallel.param_shardings(model_shapes, self.model_axes, mesh, rules)
    self.lora, self.lora_seed, self.base_dtype = lora, lora_seed, jnp.dtype(base_dtype)
    self.lora_scale = 0.0 if lora is None else lora_lib.scale(lora)
    if lora is None:
      shapes, self.axes = model_shapes, self.model_axes
    else:
      shapes, self.axes = lora_lib.adapter_shapes(config, lora), lora_lib.adapter_axes(self.model_axes, lora)
    self.param_shardings = parallel.param_shardings(shapes, self.axes, mesh, rules)
    self._replicated = parallel.replicated(mesh)
    self.tx = make_optimizer(self.optimizer_config)

    opt_shapes = jax.eval_shape(self.tx.init, shapes)
    self.opt_shardings = optax.tree_map_params(
        self.tx, lambda _, sharding: sharding, opt_shapes, self.param_shardings,
        transform_non_params=lambda _: self._replicated)
    self.compute_shardings = _stacked_shardings(self.param_shardings, mesh)
    self.model_compute_shardings = _stacked_shardings(self.model_shardings, mesh)
    self.abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if self.abstract:  # shapes only: a trainer for `lower_step` (nothing allocated, `step` refuses)
      sds = lambda x, sh, dt=None: jax.ShapeDtypeStruct(x.shape, dt or x.dtype, sharding=sh)
      self._params = jax.tree.map(lambda x, sh: sds(x, sh, jnp.float32), shapes, self.param_shardings)
      self._opt_state = jax.tree.map(sds, opt_shapes, self.opt_shardings)
      self._step = self._skipped = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)
      self._ref_params = None if ref_params is None else jax.tree.map(
          lambda x, sh: sds(x, sh, jnp.dtype(config.dtype)), model_shapes, self.model_shardings)
      self._base = None if lora is None else jax.tree.map(
          lambda x, sh: sds(x, sh, self.base_dtype), model_shapes, self.model_shardings)
    else:
      if lora is None:
        self._base = None
        self._params = self._place(params, jnp.float32)
      else:
        self._base = self._place(params, self.base_dtype, self.model_shardings)
        self._params = self._place(lora_lib.init_adapters(config, lora, lora_seed) if adapters is None else adapters,
                                   jnp.float32)
      self._opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(self._params)
      self._step = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
      self._skipped = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
      self._ref_params = None
      if ref_params is not None:
        self._ref_params = self._place(ref_params, jnp.dtype(config.dtype), self.model_shardings)

    ndims = {k: 1 if k == "advantages" else 2 for k in _BATCH_DTYPES}
    batch_sh = {k: parallel.batch_sharding(mesh, n) for k, n in ndims.items()}
    self._batch_shardings = batch_sh
    ref_sh = None if self._ref_params is None else self.model_shardings
    base_sh = None if lora is None else self.model_shardings
    frozen_sh = None if lora is None else self.model_compute_shardings
    self._train_step = jax.jit(
        self._train_step_impl,
        in_shardings=(self.param_shardings, self.opt_shardings, self._replicated, self._replicated,
                      batch_sh, ref_sh, base_sh),
        out_shardings=(self.param_shardings, self.opt_shardings, self._replicated, self._replicated,
                       self._replicated),
        donate_argnums=(0, 1, 2, 3))
    # grouped by length: the same step as separate programs (see `_grouped_step`)
    micro_sh = {k: NamedSharding(mesh, P(None, parallel.BATCH_AXES, *[None] * (n - 1))) for k, n in ndims.items()}
    self._row_lengths = jax.jit(self._row_lengths_impl, out_shardings=self._replicated)
    self._prepare_step = jax.jit(
        self._prepare_impl,
        out_shardings=(self.compute_shardings, frozen_sh,
                       None if ref_params is None else self.model_compute_shardings,
                       micro_sh, self._replicated, self.compute_shardings))
    self._accumulate_step = jax.jit(
        self._accumulate_impl, static_argnames=("width",), donate_argnums=(3,),
        out_shardings=(self.compute_shardings, (self._replicated, self._replicated, self._replicated,
                                                parallel.batch_sharding(mesh, 2))))
    self._apply_step = jax.jit(
        self._apply_impl,
        out_shardings=(self.param_shardings, self.opt_shardings, self._replicated, self._replicated,
                       self._replicated),
        donate_argnums=(0, 1, 2, 3))
    self._microbatch_index = None  # [M] replicated int32 scalars, made at the first grouped step
    self._merge = None if lora is None else jax.jit(
        lambda base, adapters: lora_lib.merge_adapters(base, adapters, self.lora_scale, jnp.float32),
        out_shardings=self.model_shardings)

  # ------------------------------------------------------------------------------------------------
  # state

  def _place(self, params, dtype, shardings=None) -> Any:
    """Copy `params` onto `shardings` (default: the trained params') in `dtype` (never aliasing the
    caller's buffers)."""
    shardings = self.param_shardings if shardings is None else shardings
    if jax.tree.structure(params) != jax.tree.structure(shardings):
      what = "LoRA adapters for this LoraConfig" if shardings is not self.model_shardings and self.lora else \
          "the model's structure for this ModelConfig"
      raise ValueError(f"params do not match {what}: expected {jax.tree.structure(shardings)}, got "
                       f"{jax.tree.structure(params)}")
    dtype = jnp.dtype(dtype)
    # device_put may alias a shard that already sits on the right device even with may_alias=False,
    # and the train step donates its params: copy device arrays first so the caller's stay valid.
    cast = lambda x: (jnp.array(x, dtype=dtype, copy=True) if isinstance(x, jax.Array)
                      else np.asarray(x, dtype))
    return jax.device_put(jax.tree.map(cast, params), shardings)

  @property
  def params(self) -> Any:
    """The trained fp32 params on the trainer mesh: the policy's, or its LoRA adapters (live buffers:
    the next `step` donates them)."""
    return self._params

  @property
  def base_params(self) -> Any:
    """The frozen base of a LoRA policy (in `base_dtype`); None without LoRA."""
    return self._base

  def policy_params(self) -> Any:
    """The whole policy's fp32 params: the masters (live buffers), or, with LoRA, a new copy of the
    base with the adapters merged (`w + alpha / rank * a @ b`)."""
    return self._params if self.lora is None else self._merge(self._base, self._params)

  @property
  def opt_state(self) -> Any:
    return self._opt_state

  @property
  def ref_params(self) -> Any:
    return self._ref_params

  @property
  def num_steps(self) -> int:
    return int(_local_value(self._step))

  def load_params(self, params: Any) -> None:
    """Make `params` (the whole model's) the policy (e.g. after a supervised warm start); the optimizer
    state is kept. With LoRA they become the frozen base (in `base_dtype`) and the adapters start again
    from their initial value (`b` = 0). With `reference_is_initial`, the KL reference becomes them too."""
    if self.lora is None:
      self._params = self._place(params, jnp.float32)
    else:
      self._base = self._place(params, self.base_dtype, self.model_shardings)
      self._params = self._place(lora_lib.init_adapters(self.config, self.lora, self.lora_seed), jnp.float32)
    if self._ref_params is not None and self.reference_is_initial:
      self._ref_params = self._place(params, jnp.dtype(self.config.dtype), self.model_shardings)

  def state_dict(self) -> dict:
    """Checkpointable state (an orbax-friendly pytree of arrays): params (with LoRA: the adapters),
    opt_state, step, skips, the KL reference policy when there is one, and a LoRA policy's frozen base
    (`base_params`, in its dtype: after a warm start it is no file's weights)."""
    state = {"params": self._params, "opt_state": self._opt_state, "step": self._step,
             "skipped_nonfinite": self._skipped}
    if self._ref_params is not None:
      state["ref_params"] = self._ref_params
    if self._base is not None:
      state["base_params"] = self._base
    return state

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Inverse of `state_dict` (arrays from host or devices are copied onto the trainer shardings)."""
    self._params = self._place(state["params"], jnp.float32)
    opt_state = jax.tree.unflatten(jax.tree.structure(self._opt_state), jax.tree.leaves(state["opt_state"]))
    self._opt_state = jax.device_put(opt_state, self.opt_shardings, may_alias=False)
    self._step = jax.device_put(jnp.asarray(state["step"], jnp.int32), self._replicated)
    self._skipped = jax.device_put(jnp.asarray(state.get("skipped_nonfinite", 0), jnp.int32),
                                   self._replicated)
    if self._ref_params is not None and "ref_params" in state:
      self._ref_params = self._place(state["ref_params"], jnp.dtype(self.config.dtype), self.model_shardings)
    if self._base is not None and "base_params" in state:
      self._base = self._place(state["base_params"], self.base_dtype, self.model_shardings)

  # ------------------------------------------------------------------------------------------------
  # the step

  def lower_step(self, batch_size: int, prompt_len: int, resp_len: int):
    """The train step lowered for `self.platform` from abstract shapes (`jax.stages.Lowered`: `.as_text()`
    is its StableHLO, `.compile()` compiles it on this backend). Nothing is allocated or run. This is
    the fused step; grouped by length, a step runs the same microbatch computation at widths up to
    this one's (P + R): the fused program is its worst case."""
    self._check_batch_size(batch_size)
    batch = {k: jax.ShapeDtypeStruct((batch_size,) if k == "advantages" else
                                     (batch_size, prompt_len if k.startswith("prompt") else resp_len),
                                     _BATCH_DTYPES[k], sharding=self._batch_shardings[k])
             for k in _BATCH_DTYPES}
    shape_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    args = jax.tree.map(shape_of, (self._params, self._opt_state, self._step, self._skipped, batch,
                                   self._ref_params, self._base))
    # a mesh over devices of a target topology (a GPU compiled for on a CPU machine) lowers for them as is
    own = self.platform == self.mesh.devices.flat[0].platform
    return self._train_step.trace(*args).lower(lowering_platforms=None if own else (self.platform,))

  def step(self, batch: ScoredBatch) -> dict[str, float]:
    """One optimizer step on `batch` (host numpy or device arrays); returns scalar metrics."""
    if self.abstract:
      raise RuntimeError("this TrainerExecutor was built from abstract params (shapes only): it can "
                         "`lower_step` but not `step`; pass real params to train")
    start = time.perf_counter()
    arrays = self._put_batch(batch)
    if self.group_by_length:
      metrics, padding_fraction = self._grouped_step(arrays)
    else:
      self._params, self._opt_state, self._step, self._skipped, metrics = self._train_step(
          self._params, self._opt_state, self._step, self._skipped, arrays, self._ref_params, self._base)
    metrics = mismatch.drop_empty_lags({k: float(_local_value(v)) for k, v in metrics.items()})  # waits
    if self.group_by_length:
      metrics["train/padding_fraction"] = padding_fraction
    elapsed = time.perf_counter() - start
    self.busy_seconds += elapsed
    metrics["time/train_step"] = elapsed
    return metrics

  def _check_batch_size(self, B: int) -> None:
    multiple = self.microbatches * parallel.batch_divisor(self.mesh)
    if B % multiple:
      raise ValueError(f"batch size {B} must be a multiple of microbatches ({self.microbatches}) x "
                       f"data*fsdp ({parallel.batch_divisor(self.mesh)}) = {multiple}; pad the batch "
                       "with rows whose response_mask is 0")

  def _put_batch(self, batch: ScoredBatch) -> dict[str, Array]:
    r = batch.rollout
    host = {"prompt_tokens": r.prompt_tokens, "prompt_mask": r.prompt_mask,
            "response_tokens": r.response_tokens, "response_mask": r.response_mask,
            "behaviour_logprobs": r.behaviour_logprobs, "advantages": batch.advantages,
            # the version of each token's weights, for the mismatch metrics' split by lag (-1: unknown)
            "token_versions": (np.full(np.shape(r.response_tokens), -1, np.int32) if r.token_versions is None
                               else r.token_versions)}
    B = np.shape(host["prompt_tokens"])[0]
    self._check_batch_size(B)
    expected = {"prompt_tokens": (B, None), "prompt_mask": np.shape(host["prompt_tokens"]),
                "response_tokens": (B, None), "response_mask": np.shape(host["response_tokens"]),
                "behaviour_logprobs": np.shape(host["response_tokens"]), "advantages": (B,),
                "token_versions": np.shape(host["response_tokens"])}
    out = {}
    for k, v in host.items():
      shape = np.shape(v)
      want = expected[k]
      if len(shape) != len(want) or any(w is not None and w != s for w, s in zip(want, shape)):
        raise ValueError(f"batch field {k} has shape {shape}, expected {want} (None = any)")
      if isinstance(v, jax.Array):
        v = v.astype(_BATCH_DTYPES[k])
      else:
        v = np.asarray(v, _BATCH_DTYPES[k])
      out[k] = jax.device_put(v, self._batch_shardings[k])
    return out

  def _grouped_step(self, batch: dict[str, Array]) -> tuple[dict[str, Array], float]:
    """The step grouped by length: lengths to the host, `group_by_length`, then prepare, one
    accumulation call per microbatch (at its width) and apply. Returns the device metrics and the
    grouping's padding fraction."""
    groups = group_by_length(_local_value(self._row_lengths(batch)), self.microbatches,
                             batch["prompt_tokens"].shape[1] + batch["response_tokens"].shape[1])
    if self._microbatch_index is None:
      self._microbatch_index = [jax.device_put(np.int32(m), self._replicated) for m in range(self.microbatches)]
    order = jax.device_put(groups.order, self._replicated)
    compute, frozen, ref_compute, micro, totals, grads = self._prepare_step(
        self._params, self._ref_params, self._base, batch, order)
    outs = []
    for index, width in zip(self._microbatch_index, groups.widths):
      grads, out = self._accumulate_step(compute, frozen, ref_compute, grads, micro, index, totals, self._step,
                                         width=width)
      outs.append(out)
    del compute, frozen, ref_compute
    self._params, self._opt_state, self._step, self._skipped, metrics = self._apply_step(
        self._params, self._opt_state, self._step, self._skipped, grads, outs, micro)
    return metrics, groups.padding_fraction

  def _microbatch_loss(self, compute, frozen, ref_compute, mb, totals, width, response_len, key):
    """This microbatch's share of the full-batch loss (see `_loss_share`), and its metrics.
    compute / ref_compute: params prepared by `prepare_params` (compute dtype, layers stacked); with
    LoRA, compute is the adapters and frozen the base (None without); key: LoRA dropout's (or None).
    width: the forward's sequence width (`policy_logprobs`; None: P + R). response_len: the batch's
    padded response length R (mb's response columns may have been cut to the width)."""
    mask = mb["response_mask"]
    kw = dict(self.loss_kwargs)
    if kw.get("aggregation") == "seq_sum_norm" and kw.get("loss_norm_constant") is None:
      kw["loss_norm_constant"] = response_len  # the loss's default, the batch's R, not a cut microbatch's
    logprobs_of = functools.partial(policy_logprobs, self.config, temperature=self.temperature,
                                    attention=self.attention, logprob_chunk=self.logprob_chunk, width=width,
                                    scan_layers=self.scan_layers)
    args = (mb["prompt_tokens"], mb["prompt_mask"], mb["response_tokens"], mask)
    policy, lora = (compute, None) if frozen is None else (frozen, compute)
    out = logprobs_of(policy, *args, remat=self.remat, with_entropy=self._with_entropy, lora=lora,
                      lora_scale=self.lora_scale, lora_dropout=0.0 if key is None else self.lora.dropout,
                      dropout_key=key)
    logprobs, kw["entropy"] = out if self._with_entropy else (out, None)
    if ref_compute is not None:
      kw["ref_logprobs"] = jax.lax.stop_gradient(logprobs_of(ref_compute, *args))
    loss, metrics = self.loss_fn(logprobs, mb["behaviour_logprobs"], mb["advantages"], mask, **kw)
    share = _loss_share(mask, totals, kw.get("aggregation", "token_mean"))
    return loss * share, (share, metrics, logprobs)

  def _accumulate(self, compute, frozen, ref_compute, grads, mb, totals, width=None, key=None):
    """grads + this microbatch's gradient (fp32, in the compute layout), and its (loss share of the
    batch, share, metrics, log-probs `[B/M, R]`). With `width`, the response columns past it (all
    padding: a row's response ends within its length <= width) are cut before the forward and the
    log-probs padded back to R."""
    R = mb["response_tokens"].shape[1]
    trimmed = mb
    if width is not None and width < R:
      trimmed = {**mb, **{k: mb[k][:, :width] for k in ("response_tokens", "response_mask", "behaviour_logprobs")}}
    grad_fn = jax.value_and_grad(self._microbatch_loss, has_aux=True)
    (loss_part, (share, metrics, logprobs)), g = grad_fn(compute, frozen, ref_compute, trimmed, totals, width, R,
                                                         key)
    grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
    grads = jax.lax.with_sharding_constraint(grads, self.compute_shardings)
    logprobs = jnp.pad(logprobs, ((0, 0), (0, R - logprobs.shape[1])))
    return grads, (loss_part, share, metrics, logprobs)

  def _prepare(self, params, ref_params, base):
    """Params cast to the compute dtype and the layers stacked, once per step (not per microbatch or
    per use); gradients are taken w.r.t. this copy and accumulated in fp32 in its layout. Returns
    (compute, frozen, ref_compute): the trained params', the LoRA base's (None without LoRA) and the
    KL reference's."""
    dtype = jnp.dtype(self.config.dtype)
    prepare = lambda p, sh: None if p is None else jax.lax.with_sharding_constraint(prepare_params(p, dtype), sh)
    return (prepare(params, self.compute_shardings), prepare(base, self.model_compute_shardings),
            prepare(ref_params, self.model_compute_shardings))

  def _split(self, batch):
    """The batch as `[M, B/M, ...]` microbatches: row j*M + m goes to microbatch m, so each device keeps
    its own rows (no resharding for the scan)."""
    M = self.microbatches

    def split(x):
      x = x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)
      return jax.lax.with_sharding_constraint(
          x, NamedSharding(self.mesh, P(None, parallel.BATCH_AXES, *([None] * (x.ndim - 2)))))

    return jax.tree.map(split, batch)

  def _train_step_impl(self, params, opt_state, step, skipped, batch, ref_params, base):
    """The fused step: prepare, a `lax.scan` of `_accumulate` over the microbatches at full width, apply."""
    self.trace_count += 1
    totals = _valid_counts(batch["response_mask"])
    micro = self._split(batch)
    compute, frozen, ref_compute = self._prepare(params, ref_params, base)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), compute)
    grads, outs = jax.lax.scan(
        lambda g, xs: self._accumulate(compute, frozen, ref_compute, g, xs[0], totals, key=self._dropout_key(step, xs[1])),
        zeros, (micro, jnp.arange(self.microbatches)))
    params, opt_state, step, skipped, metrics = self._apply(params, opt_state, step, skipped, grads, outs, micro)
    metrics["train/padding_fraction"] = _padding_fraction(batch)
    return params, opt_state, step, skipped, metrics

  # grouped by length: the fused step's parts as separate programs

  def _row_lengths_impl(self, batch):
    """`[B]` int32, each trainer row's real length (`trainer_layout`), replicated: read by the host."""
    self.trace_count += 1
    return trainer_layout(batch["prompt_tokens"], batch["prompt_mask"], batch["response_tokens"],
                          batch["response_mask"])[1]

  def _prepare_impl(self, params, ref_params, base, batch, order):
    """compute / frozen / ref_compute params, the batch's rows taken in `order` (`[B]`) and split into
    microbatches, the whole batch's normalisers, zero gradients."""
    self.trace_count += 1
    totals = _valid_counts(batch["response_mask"])
    micro = self._split(jax.tree.map(lambda x: jnp.take(x, order, axis=0), batch))
    compute, frozen, ref_compute = self._prepare(params, ref_params, base)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), compute)
    return compute, frozen, ref_compute, micro, totals, zeros

  def _accumulate_impl(self, compute, frozen, ref_compute, grads, micro, index, totals, step, *, width):
    """`_accumulate` of microbatch `index` (traced: one program per width) at `width`."""
    self.trace_count += 1
    mb = jax.tree.map(lambda x: x[index], micro)
    return self._accumulate(compute, frozen, ref_compute, grads, mb, totals, width, self._dropout_key(step, index))

  def _dropout_key(self, step, microbatch):
    """LoRA dropout's key for a step's microbatch (a function of the seed, the step and the microbatch:
    a resumed run draws the same masks); None without dropout."""
    if self.lora is None or self.lora.dropout == 0:
      return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.lora_seed), step), microbatch)

  def _apply_impl(self, params, opt_state, step, skipped, grads, outs, micro):
    """`_apply` on the microbatches' outputs (a list of M) stacked as the scan stacks them."""
    self.trace_count += 1
    outs = jax.tree.map(lambda *x: jnp.stack(x), *outs)
    return self._apply(params, opt_state, step, skipped, grads, outs, micro)

  def _apply(self, params, opt_state, step, skipped, grads, outs, micro):
    """The accumulated gradient (compute layout) -> clip + AdamW on the fp32 masters (kept when the
    loss or the gradient norm is not finite), and the step's metrics. outs: the microbatches'
    `_accumulate` outputs stacked `[M, ...]`; micro: the batch as `_split` gives it."""
    loss_parts, shares, micro_metrics, logprobs = outs
    grads = jax.lax.with_sharding_constraint(unstack_layers(grads), self.param_shardings)
    total_loss = jnp.sum(loss_parts)
    metrics = _combine_metrics(micro_metrics, shares)
    # log pi of the params this step starts from (version `step`: the n-th step's params are version n)
    # vs log mu, over the whole batch ([M, B/M, R] like `micro`), split by each token's lag
    versions = micro["token_versions"]
    lags = jnp.where(versions >= 0, step - versions, -1)
    metrics.update(mismatch.mismatch_metrics(logprobs, micro["behaviour_logprobs"], micro["response_mask"], lags))

    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(total_loss) & jnp.isfinite(grad_norm)
    lr = lr_schedule(self.optimizer_config)(_applied_updates(opt_state))
    updates, new_opt_state = self.tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)
    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    skipped = skipped + (~finite).astype(jnp.int32)
    step = step + 1
    metrics.update({
        "loss/total": total_loss, "train/grad_norm": grad_norm, "train/lr": lr,
        "train/tokens": jnp.sum(micro["response_mask"]).astype(jnp.float32), "train/skipped_nonfinite": skipped,
        "train/step": step, "train/update_applied": finite.astype(jnp.float32),
    })
    return params, opt_state, step, skipped, metrics


def _padding_fraction(batch: Mapping[str, Array]) -> Array:
  """Padded positions of the trainer's rows per real token: (B * (P + R) - sum of row lengths) / sum
  of row lengths, rows as `trainer_layout` lays them out (real prompt + response up to its end)."""
  _, lengths, _ = trainer_layout(batch["prompt_tokens"], batch["prompt_mask"], batch["response_tokens"],
                                 batch["response_mask"])
  real = jnp.sum(lengths).astype(jnp.float32)
  return (batch["prompt_tokens"].size + batch["response_tokens"].size - real) / real


def _stacked_shardings(param_shardings, mesh: Mesh):
  """Shardings of `prepare_params`' layout: each layer leaf's sharding with a replicated leading
  `[num_layers]` axis; the other leaves as they are."""
  layer0 = param_shardings["layers"][0]
  stacked = jax.tree.map(lambda sh: NamedSharding(mesh, P(None, *sh.spec)), layer0)
  return {**{k: v for k, v in param_shardings.items() if k != "layers"}, "layers": stacked}


def _local_value(x: Array) -> np.ndarray:
  """A replicated array's value from this process's own copy (also when the mesh spans processes)."""
  return np.asarray(x.addressable_data(0))


def _valid_counts(mask: Array) -> dict[str, Array]:
  """Valid tokens and non-empty sequences of `mask` `[B, R]` (the loss aggregations' normalisers)."""
  valid = mask > 0
  return {"tokens": jnp.sum(valid).astype(jnp.float32),
          "seqs": jnp.sum(jnp.any(valid, axis=-1)).astype(jnp.float32)}


def _loss_share(mask: Array, totals: Mapping[str, Array], aggregation: str) -> Array:
  """A microbatch's share of the full batch's normaliser: sum_m share_m * loss_m = loss(full batch).

  token_mean normalises by valid tokens; seq_mean_token_mean and seq_sum_norm by non-empty
  sequences (see `llamarl_jax.losses`). An empty microbatch has share 0 (its loss is 0 anyway).
  """
  key = "tokens" if aggregation == "token_mean" else "seqs"
  return _valid_counts(mask)[key] / jnp.maximum(totals[key], 1.0)


def _combine_metrics(micro: Mapping[str, Array], shares: Array) -> dict[str, Array]:
  """Per-microbatch metrics `[M]` -> the full batch's.

  loss/*: share-weighted sums (like the loss); policy/num_*: sums; *_max / *_min: max / min over
  microbatches with valid tokens; `losses.SEQUENCE_METRICS` are per-sequence means: weighted by
  sequences; every other metric is a per-token mean: token-weighted.
  """
  tokens = micro["policy/num_tokens"]
  seqs = micro["policy/num_seqs"]
  has = tokens > 0
  out = {}
  for k, v in micro.items():
    if k.startswith("loss/"):
      out[k] = jnp.sum(shares * v)
    elif k.startswith("policy/num_"):
      out[k] = jnp.sum(v)
    elif k.endswith("_max"):
      out[k] = jnp.where(jnp.any(has), jnp.max(jnp.where(has, v, -jnp.inf)), 0.0)
    elif k.endswith("_min"):
      out[k] = jnp.where(jnp.any(has), jnp.min(jnp.where(has, v, jnp.inf)), 0.0)
    elif k in losses.SEQUENCE_METRICS:
      out[k] = jnp.sum(seqs * v) / jnp.maximum(jnp.sum(seqs), 1.0)
    else:
      out[k] = jnp.sum(tokens * v) / jnp.maximum(jnp.sum(tokens), 1.0)
  return out
