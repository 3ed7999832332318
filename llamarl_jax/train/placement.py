"""Where a `TrainState` and a batch live on the trainer mesh: shardings, placement (initial, restored
and abstract states, batches).

Params are fp32 masters sharded by `parallel.RULES` (FSDP over `fsdp`, TP over `tp` when the mesh has
tp > 1); the optimizer state follows its params; the step's compute copy (`prepare_params`: layers
stacked) has each layer leaf's sharding with a replicated leading `[num_layers]` axis; a batch's rows
go over `data` x `fsdp`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llamarl_jax import parallel
from llamarl_jax.config import LoraConfig
from llamarl_jax.batch import ROUTING_FIELD, TRAIN_FIELDS, ScoredBatch
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import stacked_shardings
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Placement:
  """Shardings of a trainer's state and batches. model: the whole model's (the LoRA base, the KL
  reference); params: the trained params' (the model's, or LoRA adapters'); trained: a `TrainState`
  of shardings without its frozen parts; compute / model_compute: `prepare_params`' layouts of
  params / model; batch: each `TRAIN_FIELDS` array's (and the recorded routing's, `ROUTING_FIELD`, for a
  MoE model: `batch_fields`); micro: the same split `[M, B/M, ...]`; lora: the `LoraConfig` whose
  adapters are the trained params (None: the model's params are)."""
  mesh: Mesh
  model: Any
  params: Any
  trained: TrainState
  compute: Any
  model_compute: Any
  batch: dict
  micro: dict
  replicated: NamedSharding
  model_shapes: Any  # fp32 ShapeDtypeStructs of the model's params
  param_shapes: Any  # ... of the trained params
  lora: LoraConfig | None = None


def make_placement(config: ModelConfig, mesh: Mesh, tx: optax.GradientTransformation, *, lora: LoraConfig | None = None,
                   rules: Mapping[str, str | None] = parallel.RULES) -> Placement:
  abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  fields = batch_fields(config)
  model_axes = parallel.logical_axes(abstract)
  model_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), split_params(abstract)[1])
  model_sh = parallel.param_shardings(model_shapes, model_axes, mesh, rules)
  shapes, axes = ((model_shapes, model_axes) if lora is None else
                  (lora_lib.adapter_shapes(config, lora), lora_lib.adapter_axes(model_axes, lora)))
  param_sh = parallel.param_shardings(shapes, axes, mesh, rules)
  repl = parallel.replicated(mesh)
  opt_sh = optax.tree_map_params(tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, shapes), param_sh,
                                 transform_non_params=lambda _: repl)
  return Placement(
      mesh=mesh, model=model_sh, params=param_sh, trained=TrainState(params=param_sh, opt_state=opt_sh, step=repl,
                                                                     skipped=repl),
      compute=stacked_shardings(param_sh, mesh), model_compute=stacked_shardings(model_sh, mesh),
      batch={k: parallel.batch_sharding(mesh, field_ndim(k)) for k in fields},
      micro={k: NamedSharding(mesh, P(None, parallel.BATCH_AXES, *[None] * (field_ndim(k) - 1))) for k in fields},
      replicated=repl, model_shapes=model_shapes, param_shapes=shapes, lora=lora)


def batch_fields(config: ModelConfig) -> dict:
  """The arrays (name -> dtype) of a trainer's batch: `TRAIN_FIELDS`, and for a MoE model the
  generator's recorded routing (`ROUTING_FIELD`; -1 where nothing was recorded)."""
  return {**TRAIN_FIELDS, **(ROUTING_FIELD if config.num_experts else {})}


def field_ndim(name: str) -> int:
  """Dimensions of a batch field: `[B]` advantages, `[B, P + R, moe layers, k]` routing, `[B, *]` the rest."""
  return {"advantages": 1, "routing": 4}.get(name, 2)


def place(tree, dtype, shardings, what: str = "the model's structure for this ModelConfig") -> Any:
  """Copy `tree` onto `shardings` in `dtype`, never aliasing the caller's buffers (a step donates what
  it trains; device_put may alias a shard already on its device). what: the expected tree, for errors."""
  if jax.tree.structure(tree) != jax.tree.structure(shardings):
    raise ValueError(f"params do not match {what}: expected {jax.tree.structure(shardings)}, got "
                     f"{jax.tree.structure(tree)}")
  dtype = jnp.dtype(dtype)
  cast = lambda x: jnp.array(x, dtype=dtype, copy=True) if isinstance(x, jax.Array) else np.asarray(x, dtype)
  return jax.device_put(jax.tree.map(cast, tree), shardings)


def place_trained(placement: Placement, tree) -> Any:
  """`tree` (the model's params, or LoRA adapters with `placement.lora`) copied in fp32 onto the trained
  params' shardings."""
  what = "LoRA adapters for this LoraConfig" if placement.lora else "the model's structure for this ModelConfig"
  return place(tree, jnp.float32, placement.params, what)


def init_opt_state(placement: Placement, tx: optax.GradientTransformation, params) -> Any:
  """`tx`'s fresh state of the placed `params`, on the optimizer state's shardings."""
  return jax.jit(tx.init, out_shardings=placement.trained.opt_state)(params)


def place_opt_state(placement: Placement, like, saved) -> Any:
  """A saved optimizer state's leaves (host or device) in the structure of `like`, copied onto the
  optimizer state's shardings."""
  opt_state = jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(saved))
  return jax.device_put(opt_state, placement.trained.opt_state, may_alias=False)


def initial_state(placement: Placement, tx: optax.GradientTransformation, trained, *, base=None, base_dtype=None,
                  ref=None, ref_dtype=None) -> TrainState:
  """A step-0 `TrainState` on `placement`: `trained` (`place_trained`) with a fresh optimizer state; a
  LoRA policy's frozen `base` in `base_dtype` and the KL reference `ref` in `ref_dtype` (each None:
  none) on the whole model's shardings."""
  base = None if base is None else place(base, base_dtype, placement.model)
  trained = place_trained(placement, trained)
  ref = None if ref is None else place(ref, ref_dtype, placement.model)
  zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), placement.replicated)
  return TrainState(params=trained, opt_state=init_opt_state(placement, tx, trained), step=zero(), skipped=zero(),
                    base=base, ref=ref)


def restore_state(placement: Placement, state: TrainState, saved: Mapping[str, Any], *, base_dtype,
                  ref_dtype) -> TrainState:
  """`state` with the arrays of a `state.state_dict` (`saved`: host or device arrays) copied onto
  `placement`: params, optimizer state (its leaves in `state.opt_state`'s structure), step, skipped
  steps, and the reference / LoRA base where `state` holds one and `saved` has it."""
  repl = placement.replicated
  state = state.replace(params=place_trained(placement, saved["params"]),
                        opt_state=place_opt_state(placement, state.opt_state, saved["opt_state"]),
                        step=jax.device_put(jnp.asarray(saved["step"], jnp.int32), repl),
                        skipped=jax.device_put(jnp.asarray(saved.get("skipped_nonfinite", 0), jnp.int32), repl))
  if state.ref is not None and "ref_params" in saved:
    state = state.replace(ref=place(saved["ref_params"], ref_dtype, placement.model))
  if state.base is not None and "base_params" in saved:
    state = state.replace(base=place(saved["base_params"], base_dtype, placement.model))
  return state


def abstract_state(placement: Placement, tx, *, base_dtype=None, ref_dtype=None) -> TrainState:
  """A `TrainState` of sharded `ShapeDtypeStruct`s (fp32 params; a base in `base_dtype` / a reference
  in `ref_dtype` when given): what `lower_step` lowers from, nothing allocated."""
  sds = lambda dt: lambda x, sh: jax.ShapeDtypeStruct(x.shape, dt or x.dtype, sharding=sh)
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=placement.replicated)
  frozen = lambda dt: None if dt is None else jax.tree.map(sds(jnp.dtype(dt)), placement.model_shapes, placement.model)
  return TrainState(params=jax.tree.map(sds(jnp.float32), placement.param_shapes, placement.params),
                    opt_state=jax.tree.map(sds(None), jax.eval_shape(tx.init, placement.param_shapes),
                                           placement.trained.opt_state),
                    step=scalar, skipped=scalar, base=frozen(base_dtype), ref=frozen(ref_dtype))


def abstract_batch(placement: Placement, config: ModelConfig, batch_size: int, prompt_len: int, resp_len: int) -> dict:
  """The batch fields (`batch_fields`) of a `[batch_size]` batch as sharded `ShapeDtypeStruct`s (what
  `lower` takes)."""
  def shape(k):
    if field_ndim(k) == 1:
      return (batch_size,)
    if field_ndim(k) == 4:
      return (batch_size, prompt_len + resp_len, len(config.moe_layers), config.num_experts_per_tok)
    return (batch_size, prompt_len if k.startswith("prompt") else resp_len)
  return {k: jax.ShapeDtypeStruct(shape(k), dtype, sharding=placement.batch[k])
          for k, dtype in batch_fields(config).items()}


def check_batch_size(mesh: Mesh, microbatches: int, batch_size: int) -> None:
  """A batch splits into `microbatches` slices, each over `data` x `fsdp`; else a clear error."""
  multiple = microbatches * parallel.batch_divisor(mesh)
  if batch_size % multiple:
    raise ValueError(f"batch size {batch_size} must be a multiple of microbatches ({microbatches}) x "
                     f"data*fsdp ({parallel.batch_divisor(mesh)}) = {multiple}; pad the batch "
                     "with rows whose response_mask is 0")


def put_batch(placement: Placement, batch: ScoredBatch, microbatches: int, config: ModelConfig | None = None) -> dict:
  """`batch_arrays` of `batch` (with a MoE `config`'s routing), its size checked (`check_batch_size`),
  its rows put over `data` x `fsdp`."""
  arrays = batch_arrays(batch, config)
  check_batch_size(placement.mesh, microbatches, arrays["prompt_tokens"].shape[0])
  return jax.device_put(arrays, placement.batch)


def batch_arrays(batch: ScoredBatch, config: ModelConfig | None = None) -> dict:
  """The `TRAIN_FIELDS` of `batch` (host numpy or device arrays) in their dtypes, shapes checked:
  `[B, P]` prompts, `[B, R]` responses (and behaviour log-probs, token versions), `[B]` advantages.
  For a MoE `config` also "routing" `[B, P + R, moe layers, k]`: the rollout's recorded experts, or -1
  (the trainer's own routing) where the batch has none (`batch_fields`)."""
  r = batch.rollout
  host = {"prompt_tokens": r.prompt_tokens, "prompt_mask": r.prompt_mask,
          "response_tokens": r.response_tokens, "response_mask": r.response_mask,
          "behaviour_logprobs": r.behaviour_logprobs, "advantages": batch.advantages,
          # the version of each token's weights, for the mismatch metrics' split by lag (-1: unknown)
          "token_versions": (np.full(np.shape(r.response_tokens), -1, np.int32) if r.token_versions is None
                             else r.token_versions)}
  B = np.shape(host["prompt_tokens"])[0]
  expected = {"prompt_tokens": (B, None), "prompt_mask": np.shape(host["prompt_tokens"]),
              "response_tokens": (B, None), "response_mask": np.shape(host["response_tokens"]),
              "behaviour_logprobs": np.shape(host["response_tokens"]), "advantages": (B,),
              "token_versions": np.shape(host["response_tokens"])}
  if config is not None and config.num_experts:
    routing_shape = (len(config.moe_layers), config.num_experts_per_tok)
    P_R = np.shape(host["prompt_tokens"])[1] + np.shape(host["response_tokens"])[1]
    host["routing"] = np.full((B, P_R, *routing_shape), -1, np.int32) if r.routing is None else r.routing
    expected["routing"] = (B, P_R, *routing_shape)
  out = {}
  for k, v in host.items():
    shape, want = np.shape(v), expected[k]
    if len(shape) != len(want) or any(w is not None and w != s for w, s in zip(want, shape)):
      raise ValueError(f"batch field {k} has shape {shape}, expected {want} (None = any)")
    dtype = {**TRAIN_FIELDS, **ROUTING_FIELD}[k]
    out[k] = v.astype(dtype) if isinstance(v, jax.Array) else np.asarray(v, dtype)
  return out
