"""The trainer executor: holds a `TrainState` on the trainer mesh and runs the pure step functions of
`llamarl_jax.train` on it (LlamaRL's trainer). It places the state (`train.placement`: initial,
loaded, restored from a checkpoint) and each batch (rows over `data` x `fsdp`), and calls the step's
programs (`train.programs.TrainPrograms`: jitted with explicit shardings, the trained state donated)
in the run's layout (`TrainLayout`): padded (default), grouped by length, or packed into rows of a
token budget; all three give the same loss, gradient and metrics (up to fp32 summation order). With `lora`,
what is trained is LoRA adapters on a frozen base held in `base_dtype`. With `critic` (a
`CriticConfig`), a value model trained beside the policy on the same mesh (`executors.critic`) gives
each step's rows token-level GAE advantages before the policy's step, then takes its own optimizer
steps.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from llamarl_jax import gpu_paths, losses, mismatch, parallel
from llamarl_jax.config import CriticConfig, LoraConfig, OptimizerConfig, TrainLayout
from llamarl_jax.executors.critic import CriticExecutor
from llamarl_jax.batch import ScoredBatch
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model import moe as moe_lib
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import DEFAULT_LOGPROB_CHUNK, remat_policy, resolve_attention
from llamarl_jax.train.placement import (abstract_state, initial_state, make_placement, place, place_trained,
                                         put_batch, restore_state)
from llamarl_jax.train.programs import TrainPrograms
from llamarl_jax.train.state import make_optimizer, state_dict
from llamarl_jax.train.step import StepSpec

Array = jax.Array


class TrainerExecutor:
  """The policy's `TrainState` on the trainer mesh; `step` trains one batch.

  config: the model (its `dtype` is the compute dtype). mesh: the trainer mesh `(data, fsdp, tp)`.
  params: initial params (`split_params` dict; host or device, any dtype; copied, cast to fp32, sharded;
  `jax.ShapeDtypeStruct`s: an abstract trainer that can only `lower_step`). loss / loss_kwargs: a name
  in `losses.TRAINER_LOSSES` and its settings. microbatches: gradient-accumulation slices (B a multiple
  of microbatches * data * fsdp). layout: the step's layout (`TrainLayout`: padded, grouped or packed;
  `train.programs`), checked against the other settings by `TrainLayout.check`. ref_params: a frozen
  reference policy for a KL penalty (`kl_coef`), in the compute dtype; reference_is_initial:
  `load_params` replaces it too. lora: a `LoraConfig`: `params` become the frozen base (in
  `base_dtype`), the adapters (`adapters`, or initialised from `lora_seed`) are trained. `params`
  returns the live trained arrays (the next `step` donates them); `policy_params()` is the whole
  policy. critic: a `CriticConfig`: a value model (`self.critic`, an `executors.critic.CriticExecutor`)
  from `critic.path` or from `params` with a fresh head, on this mesh; each `step` takes the rows'
  rewards (`ScoredBatch.rewards`) to GAE advantages with it.
  A MoE policy's batches carry the generator's recorded routing (`RolloutBatch.routing`; -1 when a
  batch has none): each step logs `moe/routing_disagreement`, the share of recorded (token, MoE layer)
  pairs whose top-k the trainer's router chooses differently; routing_replay: the policy's forward
  uses the recorded experts (padded and length-grouped layouts; not packed).
  """

  def __init__(self, config: ModelConfig, mesh: Mesh, params: Any, *,
               optimizer: OptimizerConfig | None = None, loss: str = "aipo",
               loss_kwargs: Mapping[str, Any] | None = None, microbatches: int = 1, remat: bool | str = False,
               temperature: float = 1.0, ref_params: Any = None, kl_coef: float = 0.0,
               reference_is_initial: bool = False, attention: str = "auto",
               logprob_chunk: int | None = DEFAULT_LOGPROB_CHUNK, platform: str | None = None,
               layout: TrainLayout = TrainLayout(), scan_layers: bool = True,
               rules: Mapping[str, str | None] = parallel.RULES, lora: LoraConfig | None = None,
               base_dtype="float32", adapters: Any = None, lora_seed: int = 0,
               critic: CriticConfig | None = None, routing_replay: bool = False, grouped_gemm: str = "auto"):
    loss_kwargs = dict(loss_kwargs or {})
    if routing_replay and not config.num_experts:
      raise ValueError("routing_replay=True replays a mixture-of-experts policy's recorded routing, but this model "
                       f"is dense ({config.model_type!r}, num_experts=0); set routing_replay=False")
    if (kl_coef or loss_kwargs.get("kl_coef")) and ref_params is None:
      raise ValueError("a KL penalty (kl_coef > 0) needs ref_params, the reference policy's params")
    if kl_coef:
      if loss_kwargs.get("kl_coef", kl_coef) != kl_coef:
        raise ValueError(f"kl_coef given twice: {kl_coef} and loss_kwargs {loss_kwargs['kl_coef']}")
      loss_kwargs["kl_coef"] = kl_coef
    self.layout = layout.check(microbatches=microbatches, critic=critic is not None,
                               routing_replay=bool(routing_replay))
    self.config, self.mesh, self.lora, self.base_dtype = config, mesh, lora, jnp.dtype(base_dtype)
    self.optimizer_config = optimizer or OptimizerConfig()
    self.microbatches = microbatches
    self.remat, self.logprob_chunk, self.temperature = remat_policy(remat), logprob_chunk, float(temperature)
    self.platform = platform or mesh.devices.flat[0].platform  # the step's target (`lower_step`)
    self.attention = resolve_attention(attention, self.platform, config.dtype, packed=layout.packed)
    paths = {"packed_attention" if layout.packed else "trainer_attention": self.attention}
    if config.num_experts:  # the experts' grouped matmuls, for the platform the step targets
      config = config.replace(grouped_gemm=moe_lib.resolve_grouped_gemm(grouped_gemm, self.platform))
      paths["moe_grouped_gemm"] = config.grouped_gemm
      self.config = config
    gpu_paths.announce("trainer", self.platform, paths)
    self.reference_is_initial = reference_is_initial
    self.busy_seconds = 0.0
    tx = make_optimizer(self.optimizer_config)
    pl = self.placement = make_placement(config, mesh, tx, lora=lora, rules=rules)
    self.spec = StepSpec(
        model=config, loss=losses.get_loss(loss, trainer=True), optimizer=self.optimizer_config,
        loss_kwargs=loss_kwargs, microbatches=microbatches, temperature=self.temperature, attention=self.attention,
        logprob_chunk=logprob_chunk, remat=self.remat, scan_layers=bool(scan_layers), lora=lora, lora_seed=lora_seed,
        layout=layout, routing_replay=bool(routing_replay),
        mesh=mesh, param_shardings=pl.params,
        compute_shardings=pl.compute, model_compute_shardings=pl.model_compute)
    self.loss_kwargs = loss_kwargs
    compute_dtype = jnp.dtype(config.dtype)
    self.abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if self.abstract:  # shapes only: a trainer for `lower_step` (nothing allocated, `step` refuses)
      self.state = abstract_state(pl, tx, base_dtype=None if lora is None else self.base_dtype,
                                  ref_dtype=None if ref_params is None else compute_dtype)
    else:
      trained = params if lora is None else (lora_lib.init_adapters(config, lora, lora_seed) if adapters is None
                                             else adapters)
      self.state = initial_state(pl, tx, trained, base=None if lora is None else params, base_dtype=self.base_dtype,
                                 ref=ref_params, ref_dtype=compute_dtype)
    self.programs = TrainPrograms(self.spec, pl, with_base=lora is not None, with_ref=ref_params is not None)
    self.critic = None if critic is None else CriticExecutor(
        critic, config, mesh, batch_shardings=pl.batch, microbatches=self.microbatches,
        attention=self.attention, scan_layers=self.spec.scan_layers, rules=rules, params=params, abstract=self.abstract)

  # state

  params = property(lambda self: self.state.params, doc="The trained fp32 params (or LoRA adapters): live buffers.")
  base_params = property(lambda self: self.state.base, doc="A LoRA policy's frozen base (None without LoRA).")
  opt_state = property(lambda self: self.state.opt_state)
  ref_params = property(lambda self: self.state.ref)
  num_steps = property(lambda self: int(parallel.local_value(self.state.step)))
  trace_count = property(lambda self: self.programs.trace_count, doc=TrainPrograms.trace_count.__doc__)

  def policy_params(self) -> Any:
    """The whole policy's fp32 params: the masters (live buffers), or a new merged copy with LoRA."""
    return self.state.params if self.lora is None else self.programs.merge(self.state.base, self.state.params)

  def load_params(self, params: Any) -> None:
    """Make `params` (the whole model's) the policy, keeping the optimizer state. With LoRA they become
    the frozen base and the adapters restart from their initial value; with `reference_is_initial`
    they become the KL reference too; a critic started from the policy restarts from them (fresh head
    and optimizer state)."""
    pl = self.placement
    if self.lora is None:
      self.state = self.state.replace(params=place_trained(pl, params))
    else:
      self.state = self.state.replace(
          base=place(params, self.base_dtype, pl.model),
          params=place_trained(pl, lora_lib.init_adapters(self.config, self.lora, self.spec.lora_seed)))
    if self.state.ref is not None and self.reference_is_initial:
      self.state = self.state.replace(ref=place(params, jnp.dtype(self.config.dtype), pl.model))
    if self.critic is not None:
      self.critic.policy_loaded(params)

  def state_dict(self) -> dict:
    """Checkpointable state (arrays): `train.state.state_dict`'s, and the critic's under "critic"."""
    out = state_dict(self.state)
    if self.critic is not None:
      out["critic"] = self.critic.state_dict()
    return out

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Inverse of `state_dict` (arrays from host or devices are copied onto the trainer shardings)."""
    restored = restore_state(self.placement, self.state, state, base_dtype=self.base_dtype,
                             ref_dtype=jnp.dtype(self.config.dtype))
    if self.critic is not None:
      self.critic.load_state_dict(state.get("critic"))
    self.state = restored

  # the step

  def lower_step(self, batch_size: int, prompt_len: int, resp_len: int):
    """The train step (packed for a packed layout, else the fused padded step: a grouped step's worst case)
    lowered for `self.platform` from abstract shapes (`jax.stages.Lowered`). Nothing is allocated."""
    return self.programs.lower(self.state, batch_size, prompt_len, resp_len, self.platform)

  def step(self, batch: ScoredBatch) -> dict[str, float]:
    """One optimizer step on `batch` (host numpy or device arrays); returns scalar metrics."""
    if self.abstract:
      raise RuntimeError("this TrainerExecutor was built from abstract params (shapes only): it can "
                         "`lower_step` but not `step`; pass real params to train")
    start = time.perf_counter()
    arrays, critic_metrics = put_batch(self.placement, batch, self.microbatches, self.config), {}
    if self.critic is not None:
      arrays, critic_metrics = self.critic.step(arrays, batch.rewards)
      if self.num_steps < self.critic.config.warmup_steps:  # critic warm-up: the policy keeps its weights
        self.state = self.state.replace(step=self.programs.next_step(self.state.step))
        return self._finish_metrics({**critic_metrics, "train/step": self.state.step,
                                     "train/policy_updated": jnp.float32(0.0)}, None, start)
      critic_metrics["train/policy_updated"] = jnp.float32(1.0)
    self.state, metrics, layout_padding = self.programs.run(self.state, arrays)
    return self._finish_metrics({**metrics, **critic_metrics}, layout_padding, start)

  def _finish_metrics(self, metrics, layout_padding, start) -> dict[str, float]:
    """The device metrics as floats (waits for the step), the host's padding fraction, the step time."""
    metrics = mismatch.drop_empty_lags({k: float(parallel.local_value(v)) for k, v in metrics.items()})
    if layout_padding is not None:
      metrics["train/padding_fraction"] = layout_padding
    elapsed = time.perf_counter() - start
    self.busy_seconds += elapsed
    metrics["time/train_step"] = elapsed
    return metrics
