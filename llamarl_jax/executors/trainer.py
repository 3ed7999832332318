"""The trainer executor: holds a `TrainState` on the trainer mesh and runs the pure step functions of
`llamarl_jax.train` on it (LlamaRL's trainer); each program jitted with explicit shardings, the
trained state donated. `step(batch)` puts the batch's rows over `data` x `fsdp` and runs one layout:

  padded (default):  one program, `train_step`: every microbatch at the batch's width P + R;
  group_by_length:   the rows' lengths to the host (one `[B]` transfer), `group_by_length`, then
                     prepare, one accumulation per microbatch at its width (a program per width), apply;
  pack:              the lengths to the host, `pack_rows` into rows of `tokens_per_microbatch` tokens,
                     then one program, `packed_train_step`, whatever the lengths.

All three give the same loss, gradient and metrics (up to fp32 summation order). With `lora`, what
is trained is LoRA adapters on a frozen base held in `base_dtype`. With `critic` (a `CriticConfig`), a
value model trained beside the policy on the same mesh (`train.critic`) gives each step's rows
token-level GAE advantages before the policy's step, then takes its own optimizer steps.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from llamarl_jax import losses, mismatch, parallel
from llamarl_jax.config import CriticConfig, LoraConfig, OptimizerConfig
from llamarl_jax.executors.critic import CriticExecutor
from llamarl_jax.generation.rollout import ScoredBatch
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model.llama import DEFAULT_LOGPROB_CHUNK, ModelConfig, remat_policy, resolve_attention
from llamarl_jax.model.logprobs import policy_logprobs, token_logprobs  # noqa: F401  (the trainer's forward)
from llamarl_jax.train import step as steps
from llamarl_jax.train.layout import group_by_length, pack_rows, width_bucket  # noqa: F401
from llamarl_jax.train.packed import PLAN_FIELDS, check_token_budget, packed_train_step
from llamarl_jax.train.placement import abstract_state, batch_arrays, batch_fields, field_ndim, make_placement, place
from llamarl_jax.train.state import TrainState, lr_schedule, make_optimizer  # noqa: F401

Array = jax.Array


def run_trainer_options(run) -> dict:
  """The `TrainerExecutor` keyword settings a `RunConfig` sets (the Controller's trainer and the memory
  plan's abstract one are built from the same)."""
  t, r = run.train, run.rollout
  return dict(optimizer=t.optimizer, loss=t.loss, loss_kwargs=t.loss_kwargs, microbatches=t.microbatches,
              remat=t.remat, attention=t.attention, logprob_chunk=t.logprob_chunk,
              group_by_length=t.group_by_length, scan_layers=t.scan_layers,
              temperature=max(r.temperature, 1e-6) if r.temperature > 0 else 1.0,
              reference_is_initial=t.reference_path is None, lora=t.lora, base_dtype=run.generator.dtype,
              pack=t.pack, tokens_per_microbatch=t.tokens_per_microbatch, critic=t.critic,
              routing_replay=t.routing_replay)


class TrainerExecutor:
  """The policy's `TrainState` on the trainer mesh; `step` trains one batch.

  config: the model (its `dtype` is the compute dtype). mesh: the trainer mesh `(data, fsdp, tp)`.
  params: initial params (`split_params` dict; host or device, any dtype; copied, cast to fp32, sharded;
  `jax.ShapeDtypeStruct`s: an abstract trainer that can only `lower_step`). loss / loss_kwargs: a name
  in `losses.TRAINER_LOSSES` and its settings. microbatches: gradient-accumulation slices (B a multiple
  of microbatches * data * fsdp). group_by_length / pack + tokens_per_microbatch: the step's layout
  (module docstring). ref_params: a frozen reference policy for a KL penalty (`kl_coef`), in the
  compute dtype; reference_is_initial: `load_params` replaces it too. lora: a `LoraConfig`: `params`
  become the frozen base (in `base_dtype`), the adapters (`adapters`, or initialised from
  `lora_seed`) are trained. `params` returns the live trained arrays (the next `step` donates them);
  `policy_params()` is the whole policy. critic: a `CriticConfig`: a value model (`self.critic`, an
  `executors.critic.CriticExecutor`) from `critic.path` or from `params` with a fresh head, on this
  mesh; each `step` takes the rows' rewards (`ScoredBatch.rewards`) to GAE advantages with it.
  A MoE policy's batches carry the generator's recorded routing (`RolloutBatch.routing`; -1 when a
  batch has none): each step logs `moe/routing_disagreement`, the share of recorded (token, MoE layer)
  pairs whose top-k the trainer's router chooses differently; routing_replay: the policy's forward
  uses the recorded experts (padded and length-grouped layouts; not with pack).
  """

  def __init__(self, config: ModelConfig, mesh: Mesh, params: Any, *,
               optimizer: OptimizerConfig | None = None, loss: str = "aipo",
               loss_kwargs: Mapping[str, Any] | None = None, microbatches: int = 1, remat: bool | str = False,
               temperature: float = 1.0, ref_params: Any = None, kl_coef: float = 0.0,
               reference_is_initial: bool = False, attention: str = "auto",
               logprob_chunk: int | None = DEFAULT_LOGPROB_CHUNK, platform: str | None = None,
               group_by_length: bool = False, scan_layers: bool = True,
               rules: Mapping[str, str | None] = parallel.RULES, lora: LoraConfig | None = None,
               base_dtype="float32", adapters: Any = None, lora_seed: int = 0, pack: bool = False,
               tokens_per_microbatch: int | None = None, critic: CriticConfig | None = None,
               routing_replay: bool = False):
    loss_kwargs = dict(loss_kwargs or {})
    if routing_replay and not config.num_experts:
      raise ValueError("routing_replay=True replays a mixture-of-experts policy's recorded routing, but this model "
                       f"is dense ({config.model_type!r}, num_experts=0); set routing_replay=False")
    if routing_replay and pack:
      raise ValueError("routing_replay=True runs on the padded or length-grouped layout; the packed step (pack=True) "
                       "does not replay routing: set pack=False")
    if (kl_coef or loss_kwargs.get("kl_coef")) and ref_params is None:
      raise ValueError("a KL penalty (kl_coef > 0) needs ref_params, the reference policy's params")
    if kl_coef:
      if loss_kwargs.get("kl_coef", kl_coef) != kl_coef:
        raise ValueError(f"kl_coef given twice: {kl_coef} and loss_kwargs {loss_kwargs['kl_coef']}")
      loss_kwargs["kl_coef"] = kl_coef
    if pack and (group_by_length or microbatches != 1 or not tokens_per_microbatch or tokens_per_microbatch < 1):
      raise ValueError(f"pack=True takes its microbatches from the token budget: it needs tokens_per_microbatch >= 1 "
                       f"(got {tokens_per_microbatch}), microbatches = 1 (got {microbatches}) and group_by_length off "
                       f"(got {group_by_length})")
    self.config, self.mesh, self.lora, self.base_dtype = config, mesh, lora, jnp.dtype(base_dtype)
    self.optimizer_config = optimizer or OptimizerConfig()
    self.microbatches, self.group_by_length, self.pack = microbatches, bool(group_by_length), bool(pack)
    self.remat, self.logprob_chunk, self.temperature = remat_policy(remat), logprob_chunk, float(temperature)
    self.platform = platform or mesh.devices.flat[0].platform  # the step's target (`lower_step`)
    self.attention = resolve_attention(attention, self.platform, config.dtype)
    self.reference_is_initial = reference_is_initial
    self.busy_seconds = 0.0
    tx = make_optimizer(self.optimizer_config)
    pl = self.placement = make_placement(config, mesh, tx, lora=lora, rules=rules)
    self.model_shardings, self.param_shardings, self._replicated = pl.model, pl.params, pl.replicated
    self.spec = steps.StepSpec(
        model=config, loss=losses.get_loss(loss, trainer=True), optimizer=self.optimizer_config,
        loss_kwargs=loss_kwargs, microbatches=microbatches, temperature=self.temperature, attention=self.attention,
        logprob_chunk=logprob_chunk, remat=self.remat, scan_layers=bool(scan_layers), lora=lora, lora_seed=lora_seed,
        tokens_per_microbatch=tokens_per_microbatch if pack else None, routing_replay=bool(routing_replay),
        mesh=mesh, param_shardings=pl.params,
        compute_shardings=pl.compute, model_compute_shardings=pl.model_compute)
    self.loss_kwargs = loss_kwargs
    compute_dtype = jnp.dtype(config.dtype)
    self.abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if self.abstract:  # shapes only: a trainer for `lower_step` (nothing allocated, `step` refuses)
      self.state = abstract_state(pl, tx, base_dtype=None if lora is None else self.base_dtype,
                                  ref_dtype=None if ref_params is None else compute_dtype)
    else:
      base = None if lora is None else self._place(params, self.base_dtype, pl.model)
      trained = params if lora is None else (lora_lib.init_adapters(config, lora, lora_seed) if adapters is None
                                             else adapters)
      trained = self._place(trained, jnp.float32)
      ref = None if ref_params is None else self._place(ref_params, compute_dtype, pl.model)
      zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), pl.replicated)
      self.state = TrainState(params=trained, opt_state=jax.jit(tx.init, out_shardings=pl.trained.opt_state)(trained),
                              step=zero(), skipped=zero(), base=base, ref=ref)

    # the programs: the trained state donated, the frozen parts (base, ref) passed beside it
    repl, trained_sh = pl.replicated, pl.trained
    frozen_sh = (None if lora is None else pl.model, None if ref_params is None else pl.model)
    with_frozen = lambda fn: lambda trained, frozen, *a: fn(self.spec, trained.replace(base=frozen[0], ref=frozen[1]), *a)
    trained_only = lambda fn: lambda *a: (lambda state, metrics: (state.trained, metrics))(*fn(*a))
    self._train_step = jax.jit(trained_only(with_frozen(steps.train_step)), donate_argnums=(0,),
                               in_shardings=(trained_sh, frozen_sh, pl.batch), out_shardings=(trained_sh, repl))
    self._packed_step = jax.jit(trained_only(with_frozen(packed_train_step)), donate_argnums=(0,),
                                in_shardings=(trained_sh, frozen_sh, pl.batch, repl), out_shardings=(trained_sh, repl))
    # the rows' lengths (grouped and packed layouts), a function of its own (a jit cache is per
    # function: `trace_count` counts this trainer's programs only)
    self._row_lengths = jax.jit(lambda batch: steps.row_lengths(batch), out_shardings=repl)
    # grouped by length: the fused step's parts as separate programs (see `_grouped_step`)
    self._prepare_step = jax.jit(with_frozen(steps.prepare_grouped), out_shardings=(
        pl.compute, frozen_sh[0] and pl.model_compute, frozen_sh[1] and pl.model_compute, pl.micro, repl, pl.compute))
    self._accumulate_step = jax.jit(functools.partial(steps.accumulate_microbatch, self.spec),
                                    static_argnames=("width",), donate_argnums=(3,),
                                    out_shardings=(pl.compute, (repl, repl, repl, parallel.batch_sharding(mesh, 2))))
    self._apply_step = jax.jit(functools.partial(steps.apply_grouped, self.spec), donate_argnums=(0,),
                               out_shardings=(trained_sh, repl))
    self._microbatch_index = None  # [M] replicated int32 scalars, made at the first grouped step
    if critic is not None and self.pack:
      raise ValueError("a critic trains on the padded or length-grouped layout; pack=True is not supported with it")
    self.critic = None if critic is None else CriticExecutor(
        critic, config, mesh, batch_shardings=self.placement.batch, microbatches=self.microbatches,
        attention=self.attention, scan_layers=self.spec.scan_layers, rules=rules, params=params, abstract=self.abstract)
    self._next_step = jax.jit(lambda step: step + 1, out_shardings=repl)
    self._merge = None if lora is None else jax.jit(
        lambda base, adapters: lora_lib.merge_adapters(base, adapters, self.spec.lora_scale, jnp.float32),
        out_shardings=self.model_shardings)

  # state

  def _place(self, params, dtype, shardings=None) -> Any:
    """`placement.place` onto `shardings` (default: the trained params')."""
    if shardings is None:
      return place(params, dtype, self.param_shardings,
                   "LoRA adapters for this LoraConfig" if self.lora else "the model's structure for this ModelConfig")
    return place(params, dtype, shardings)

  params = property(lambda self: self.state.params, doc="The trained fp32 params (or LoRA adapters): live buffers.")
  base_params = property(lambda self: self.state.base, doc="A LoRA policy's frozen base (None without LoRA).")
  opt_state = property(lambda self: self.state.opt_state)
  ref_params = property(lambda self: self.state.ref)
  num_steps = property(lambda self: int(_local_value(self.state.step)))

  @property
  def trace_count(self) -> int:
    """Train-step programs compiled so far (the jit caches' entries, never a counter bumped under trace)."""
    return sum(f._cache_size() for f in (self._train_step, self._packed_step, self._row_lengths, self._prepare_step,
                                         self._accumulate_step, self._apply_step))

  def policy_params(self) -> Any:
    """The whole policy's fp32 params: the masters (live buffers), or a new merged copy with LoRA."""
    return self.state.params if self.lora is None else self._merge(self.state.base, self.state.params)

  def load_params(self, params: Any) -> None:
    """Make `params` (the whole model's) the policy, keeping the optimizer state. With LoRA they become
    the frozen base and the adapters restart from their initial value; with `reference_is_initial`
    they become the KL reference too; a critic started from the policy restarts from them (fresh head
    and optimizer state)."""
    if self.lora is None:
      self.state = self.state.replace(params=self._place(params, jnp.float32))
    else:
      self.state = self.state.replace(
          base=self._place(params, self.base_dtype, self.model_shardings),
          params=self._place(lora_lib.init_adapters(self.config, self.lora, self.spec.lora_seed), jnp.float32))
    if self.state.ref is not None and self.reference_is_initial:
      self.state = self.state.replace(ref=self._place(params, jnp.dtype(self.config.dtype), self.model_shardings))
    if self.critic is not None:
      self.critic.policy_loaded(params)

  def state_dict(self) -> dict:
    """Checkpointable state (arrays): params, opt_state, step, skipped_nonfinite, and ref_params /
    base_params when there are."""
    s = self.state
    out = {"params": s.params, "opt_state": s.opt_state, "step": s.step, "skipped_nonfinite": s.skipped}
    out.update({k: v for k, v in (("ref_params", s.ref), ("base_params", s.base)) if v is not None})
    if self.critic is not None:
      out["critic"] = self.critic.state_dict()
    return out

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Inverse of `state_dict` (arrays from host or devices are copied onto the trainer shardings)."""
    s, repl = self.state, self._replicated
    opt_state = jax.tree.unflatten(jax.tree.structure(s.opt_state), jax.tree.leaves(state["opt_state"]))
    s = s.replace(params=self._place(state["params"], jnp.float32),
                  opt_state=jax.device_put(opt_state, self.placement.trained.opt_state, may_alias=False),
                  step=jax.device_put(jnp.asarray(state["step"], jnp.int32), repl),
                  skipped=jax.device_put(jnp.asarray(state.get("skipped_nonfinite", 0), jnp.int32), repl))
    if s.ref is not None and "ref_params" in state:
      s = s.replace(ref=self._place(state["ref_params"], jnp.dtype(self.config.dtype), self.model_shardings))
    if s.base is not None and "base_params" in state:
      s = s.replace(base=self._place(state["base_params"], self.base_dtype, self.model_shardings))
    if self.critic is not None:
      self.critic.load_state_dict(state.get("critic"))
    self.state = s

  # the step

  def lower_step(self, batch_size: int, prompt_len: int, resp_len: int):
    """The train step (packed with `pack`, else the fused padded step: a grouped step's worst case)
    lowered for `self.platform` from abstract shapes (`jax.stages.Lowered`). Nothing is allocated."""
    self._check_batch_size(batch_size)
    c = self.config
    shape = lambda k: {1: (batch_size,), 4: (batch_size, prompt_len + resp_len, len(c.moe_layers),
                                             c.num_experts_per_tok)}.get(
        field_ndim(k), (batch_size, prompt_len if k.startswith("prompt") else resp_len))
    batch = {k: jax.ShapeDtypeStruct(shape(k), dtype, sharding=self.placement.batch[k])
             for k, dtype in batch_fields(c).items()}
    shape_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    args = [*jax.tree.map(shape_of, (self.state.trained, (self.state.base, self.state.ref))), batch]
    if self.pack:
      args.append({**{k: jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=self._replicated) for k in PLAN_FIELDS},
                   "microbatches": jax.ShapeDtypeStruct((), jnp.int32, sharding=self._replicated)})
    own = self.platform == self.mesh.devices.flat[0].platform  # else a target topology compiled for here
    fn = self._packed_step if self.pack else self._train_step
    return fn.trace(*args).lower(lowering_platforms=None if own else (self.platform,))

  def step(self, batch: ScoredBatch) -> dict[str, float]:
    """One optimizer step on `batch` (host numpy or device arrays); returns scalar metrics."""
    if self.abstract:
      raise RuntimeError("this TrainerExecutor was built from abstract params (shapes only): it can "
                         "`lower_step` but not `step`; pass real params to train")
    start = time.perf_counter()
    arrays, frozen, layout_padding = self._put_batch(batch), (self.state.base, self.state.ref), None
    critic_metrics = {}
    if self.critic is not None:
      arrays, critic_metrics = self.critic.step(arrays, batch.rewards)
      if self.num_steps < self.critic.config.warmup_steps:  # critic warm-up: the policy keeps its weights
        self.state = self.state.replace(step=self._next_step(self.state.step))
        return self._finish_metrics({**critic_metrics, "train/step": self.state.step,
                                     "train/policy_updated": jnp.float32(0.0)}, None, start)
    if self.group_by_length:
      trained, metrics, layout_padding = self._grouped_step(arrays)
    elif self.pack:
      check_token_budget(arrays["prompt_tokens"].shape[1], arrays["response_tokens"].shape[1],
                         self.spec.tokens_per_microbatch)
      plan = pack_rows(_local_value(self._row_lengths(arrays)), self.spec.tokens_per_microbatch, self.spec.shards)
      plan_arrays = {**{k: getattr(plan, k) for k in PLAN_FIELDS}, "microbatches": np.int32(plan.microbatches)}
      trained, metrics = self._packed_step(self.state.trained, frozen, arrays,
                                           jax.device_put(plan_arrays, self._replicated))
    else:
      trained, metrics = self._train_step(self.state.trained, frozen, arrays)
    self.state = trained.replace(base=frozen[0], ref=frozen[1])
    if self.critic is not None:
      metrics = {**metrics, **critic_metrics, "train/policy_updated": jnp.float32(1.0)}
    return self._finish_metrics(metrics, layout_padding, start)

  def _finish_metrics(self, metrics, layout_padding, start) -> dict[str, float]:
    metrics = mismatch.drop_empty_lags({k: float(_local_value(v)) for k, v in metrics.items()})  # waits
    if layout_padding is not None:
      metrics["train/padding_fraction"] = layout_padding
    elapsed = time.perf_counter() - start
    self.busy_seconds += elapsed
    metrics["time/train_step"] = elapsed
    return metrics

  def _grouped_step(self, batch: dict[str, Array]):
    """Lengths to the host, `group_by_length`, then prepare, one accumulation call per microbatch (at
    its width) and apply. Returns the next trained state, the device metrics and the padding fraction."""
    groups = group_by_length(_local_value(self._row_lengths(batch)), self.microbatches,
                             batch["prompt_tokens"].shape[1] + batch["response_tokens"].shape[1])
    if self._microbatch_index is None:
      self._microbatch_index = [jax.device_put(np.int32(m), self._replicated) for m in range(self.microbatches)]
    order = jax.device_put(groups.order, self._replicated)
    compute, frozen, ref_compute, micro, totals, grads = self._prepare_step(
        self.state.trained, (self.state.base, self.state.ref), batch, order)
    outs = []
    for index, width in zip(self._microbatch_index, groups.widths):
      grads, out = self._accumulate_step(compute, frozen, ref_compute, grads, micro, index, totals, self.state.step,
                                         width=width)
      outs.append(out)
    del compute, frozen, ref_compute
    trained, metrics = self._apply_step(self.state.trained, grads, outs, micro)
    return trained, metrics, groups.padding_fraction

  def _check_batch_size(self, B: int) -> None:
    multiple = self.microbatches * parallel.batch_divisor(self.mesh)
    if B % multiple:
      raise ValueError(f"batch size {B} must be a multiple of microbatches ({self.microbatches}) x "
                       f"data*fsdp ({parallel.batch_divisor(self.mesh)}) = {multiple}; pad the batch "
                       "with rows whose response_mask is 0")

  def _put_batch(self, batch: ScoredBatch) -> dict[str, Array]:
    arrays = batch_arrays(batch, self.config)
    self._check_batch_size(arrays["prompt_tokens"].shape[0])
    return jax.device_put(arrays, self.placement.batch)


def _local_value(x: Array) -> np.ndarray:
  """A replicated array's value from this process's own copy (also when the mesh spans processes)."""
  return np.asarray(x.addressable_data(0))
