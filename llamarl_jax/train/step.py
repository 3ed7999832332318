"""The train step as pure functions: `train_step(spec, state, batch) -> (state, metrics)`.

One step trains one batch of `microbatches` slices (gradient accumulation inside):

  prepare:    the trained params (and the LoRA base, the KL reference) cast to the compute dtype with
              the layers stacked (`prepare_params`), once per step;
  accumulate: per microbatch, log-probs of the response tokens under the policy (`model.logprobs`:
              layers under scan, causal attention with per-row lengths, lm_head in chunks), the loss
              (`losses`, chosen by name) times the microbatch's share of the batch's normaliser, and
              its gradient w.r.t. the compute copy, summed in fp32;
  apply:      global-norm clipping and AdamW on the fp32 masters (`TrainState`); a non-finite loss or
              gradient norm keeps the old params and optimizer state and counts a skipped step.

Microbatching is exact: a microbatch's loss is weighted by its share of the batch's normaliser
(valid tokens for `token_mean`, valid sequences otherwise), so the summed gradient is the full
batch's. The fused step runs the three as one program (a `lax.scan` over microbatches); grouped by
length, they are separate programs (`prepare_grouped`, `accumulate_microbatch` per width,
`apply_grouped`); packed, `llamarl_jax.train.packed`. The same step with `losses.nll_loss` is the
supervised warm start.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llamarl_jax import mismatch, parallel
from llamarl_jax.config import LoraConfig, OptimizerConfig, TrainLayout
from llamarl_jax.batch import routing_in_trainer_layout, trainer_layout
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.model import moe as moe_lib
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import DEFAULT_LOGPROB_CHUNK, prepare_params, unstack_layers
from llamarl_jax.model.logprobs import policy_logprobs
from llamarl_jax.train.metrics import combine_metrics, loss_share, valid_counts
from llamarl_jax.train.state import TrainState, applied_updates, lr_schedule, make_optimizer

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What a step computes, fixed for a run (the step functions close over it).

  model: the architecture (its dtype is the compute dtype); loss: a `losses` function with
  `loss_kwargs`; optimizer: `make_optimizer`'s config; microbatches: slices of the batch (padded
  layouts); temperature: the sampling temperature log-probs are taken at; attention ('xla' |
  'cudnn'), logprob_chunk, remat ('none' | 'matmuls' | 'full'), scan_layers: the forward's
  (`scan_hidden_states`); lora / lora_seed: LoRA adapters are what is trained (dropout keys from the
  seed, step and microbatch); mismatch: report the trainer-generator mismatch metrics;
  layout: how the rows go through the step (`TrainLayout`: padded, grouped, or packed into rows of
  `layout.tokens` tokens, `train.packed`). mesh and the shardings (None: no
  constraints): the trained params' (`param_shardings`), their compute layout's, the whole model's
  compute layout's (base, reference). routing_replay: a MoE policy's forward uses the experts the
  generator recorded (the batch's "routing", `RolloutBatch.routing`; `model.moe`)."""
  model: ModelConfig
  loss: Callable[..., tuple[Array, dict[str, Array]]]
  optimizer: OptimizerConfig
  loss_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  microbatches: int = 1
  temperature: float = 1.0
  attention: str = "xla"
  logprob_chunk: int | None = DEFAULT_LOGPROB_CHUNK
  remat: str = "none"
  scan_layers: bool = True
  lora: LoraConfig | None = None
  lora_seed: int = 0
  mismatch: bool = True
  layout: TrainLayout = TrainLayout()
  routing_replay: bool = False
  mesh: Mesh | None = None
  param_shardings: Any = None
  compute_shardings: Any = None
  model_compute_shardings: Any = None

  def __post_init__(self):
    if self.microbatches < 1:
      raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
    if self.temperature <= 0:
      raise ValueError(f"temperature must be > 0 (the sampling temperature; use 1.0 for greedy), got "
                       f"{self.temperature}")
    if self.logprob_chunk is not None and self.logprob_chunk < 1:
      raise ValueError(f"logprob_chunk must be a positive number of positions (or None: unchunked), got "
                       f"{self.logprob_chunk}")
    for reserved in ("ref_logprobs", "entropy"):
      if reserved in self.loss_kwargs:
        raise ValueError(f"loss_kwargs must not contain {reserved!r}: the trainer computes it")

  @property
  def with_entropy(self) -> bool:
    return bool(self.loss_kwargs.get("entropy_coef", 0.0))

  @property
  def lora_scale(self) -> float:
    return 0.0 if self.lora is None else lora_lib.scale(self.lora)

  @property
  def tx(self) -> optax.GradientTransformation:
    return make_optimizer(self.optimizer)

  @property
  def shards(self) -> int:
    """Data-parallel shards of the batch's rows (1 without a mesh)."""
    return 1 if self.mesh is None else parallel.batch_divisor(self.mesh)


def constrain(x, shardings):
  """`x` under `with_sharding_constraint(shardings)`; as it is when shardings is None (no mesh)."""
  return x if shardings is None else jax.lax.with_sharding_constraint(x, shardings)


def prepare(spec: StepSpec, state: TrainState):
  """Params cast to the compute dtype and the layers stacked, once per step (not per microbatch or
  per use); gradients are taken w.r.t. this copy and accumulated in fp32 in its layout. Returns
  (compute, frozen, ref_compute): the trained params', the LoRA base's (None without LoRA) and the
  KL reference's."""
  dtype = jnp.dtype(spec.model.dtype)
  prep = lambda p, sh: None if p is None else constrain(prepare_params(p, dtype), sh)
  return (prep(state.params, spec.compute_shardings), prep(state.base, spec.model_compute_shardings),
          prep(state.ref, spec.model_compute_shardings))


def dropout_key(spec: StepSpec, step, microbatch):
  """LoRA dropout's key for a step's microbatch (a function of the seed, the step and the microbatch:
  a resumed run draws the same masks); None without dropout."""
  if spec.lora is None or spec.lora.dropout == 0:
    return None
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(spec.lora_seed), step), microbatch)


def policy_loss(spec: StepSpec, logprobs_of, compute, frozen, ref_compute, mb, mask, totals, response_len, key,
                recorded=None):
  """This microbatch's share of the full-batch loss, and (share, metrics, log-probs `[rows, R]`).

  logprobs_of(params, **forward options): the microbatch's log-probs `[rows, R]` (masked to 0) under
  prepared `params`; compute / ref_compute: prepared params (with LoRA, compute is the adapters and
  frozen the base); mb: the batch fields the loss reads (`behaviour_logprobs`, `advantages`); mask:
  the tokens the loss sees; response_len: the batch's padded response length R (the default
  `seq_sum_norm` constant, whatever the microbatch's width); key: LoRA dropout's (or None); recorded:
  the generator's routing in the forward's layout `[rows, T, moe layers, k]` (-1: none), or None."""
  kw = dict(spec.loss_kwargs)
  if kw.get("aggregation") == "seq_sum_norm" and kw.get("loss_norm_constant") is None:
    kw["loss_norm_constant"] = response_len  # the loss's default, the batch's R, not a cut microbatch's
  policy, lora = (compute, None) if frozen is None else (frozen, compute)
  routed = spec.model.num_experts > 0  # a MoE policy: its routing trace for the load-balancing loss
  out = logprobs_of(policy, remat=spec.remat, with_entropy=spec.with_entropy, lora=lora,
                    lora_scale=spec.lora_scale, lora_dropout=0.0 if key is None else spec.lora.dropout,
                    dropout_key=key, **({"with_routing": True} if routed else {}))
  out, trace = out if routed else (out, None)
  logprobs, kw["entropy"] = out if spec.with_entropy else (out, None)
  if ref_compute is not None:
    kw["ref_logprobs"] = jax.lax.stop_gradient(logprobs_of(ref_compute))
  loss, metrics = spec.loss(logprobs, mb["behaviour_logprobs"], mb["advantages"], mask, **kw)
  if trace is not None:  # + router_aux_loss_coef x transformers' load-balancing loss of this forward
    aux = trace.aux_loss()
    loss = loss + spec.model.router_aux_loss_coef * aux
    metrics = {**metrics, "loss/moe_aux": aux}
    if recorded is not None:
      seen = jnp.all(recorded >= 0, axis=(2, 3)) & (jnp.arange(recorded.shape[1])[None] < trace.topk.shape[1])
      metrics["moe/routing_disagreement"] = moe_lib.routing_disagreement(trace.topk[:, :recorded.shape[1]],
                                                                         recorded, seen)
  share = loss_share(mask, totals, kw.get("aggregation", "token_mean"))
  return loss * share, (share, metrics, logprobs)


def _padded_loss(compute, spec, frozen, ref_compute, mb, totals, width, response_len, key):
  """`policy_loss` of a padded microbatch (rows of `trainer_layout`, `width` positions; None: P + R).
  With the generator's routing in the batch ("routing"), the policy's forward replays it
  (`spec.routing_replay`) or not, and `moe/routing_disagreement` reports the share of recorded
  (token, MoE layer) pairs whose top-k the trainer's router chose differently."""
  recorded = None
  if "routing" in mb:
    recorded = routing_in_trainer_layout(mb["prompt_mask"], mb["routing"])
    T = mb["prompt_tokens"].shape[1] + mb["response_tokens"].shape[1]
    recorded = recorded[:, :T if width is None else min(width, T)]
  replay = recorded if spec.routing_replay else None

  def logprobs_of(params, **kw):
    return policy_logprobs(
        spec.model, params, mb["prompt_tokens"], mb["prompt_mask"], mb["response_tokens"], mb["response_mask"],
        temperature=spec.temperature, attention=spec.attention, logprob_chunk=spec.logprob_chunk, width=width,
        scan_layers=spec.scan_layers, mesh=spec.mesh, **({"replay": replay} if "with_routing" in kw else {}), **kw)

  return policy_loss(spec, logprobs_of, compute, frozen, ref_compute, mb, mb["response_mask"], totals, response_len,
                     key, recorded)


def accumulate(spec: StepSpec, compute, frozen, ref_compute, grads, mb, totals, width=None, key=None):
  """grads + this microbatch's gradient (fp32, in the compute layout), and its (loss share of the
  batch, share, metrics, log-probs `[B/M, R]`). With `width`, the response columns past it (all
  padding: a row's response ends within its length <= width) are cut before the forward and the
  log-probs padded back to R."""
  R = mb["response_tokens"].shape[1]
  trimmed = mb
  if width is not None and width < R:
    cut = ("response_tokens", "response_mask", "behaviour_logprobs") + (("advantages",) if mb["advantages"].ndim == 2
                                                                          else ())  # per-token advantages
    trimmed = {**mb, **{k: mb[k][:, :width] for k in cut}}
  grad_fn = jax.value_and_grad(_padded_loss, has_aux=True)
  (loss_part, (share, metrics, logprobs)), g = grad_fn(compute, spec, frozen, ref_compute, trimmed, totals, width,
                                                       R, key)
  grads = constrain(jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g), spec.compute_shardings)
  logprobs = jnp.pad(logprobs, ((0, 0), (0, R - logprobs.shape[1])))
  return grads, (loss_part, share, metrics, logprobs)


def split_microbatches(spec: StepSpec, batch):
  """The batch as `[M, B/M, ...]` microbatches: row j*M + m goes to microbatch m, so each device keeps
  its own rows (no resharding for the scan)."""
  M = spec.microbatches

  def split(x):
    x = x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)
    if spec.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(spec.mesh, P(None, parallel.BATCH_AXES, *([None] * (x.ndim - 2)))))

  return jax.tree.map(split, batch)


def apply_update(spec: StepSpec, state: TrainState, grads, loss_parts, shares, micro_metrics, tokens):
  """The accumulated gradient (compute layout) -> clip + AdamW on the fp32 masters (kept when the loss
  or the gradient norm is not finite), and the step's metrics. loss_parts, shares, micro_metrics:
  the microbatches' `[M]`; tokens: (logprobs, behaviour_logprobs, response_mask, token_versions) of
  the whole batch in any one layout (`[M, B/M, R]` or `[B, R]`), for the mismatch metrics."""
  logprobs, behaviour, mask, versions = tokens
  grads = constrain(unstack_layers(grads), spec.param_shardings)
  total_loss = jnp.sum(loss_parts)
  metrics = combine_metrics(micro_metrics, shares)
  if spec.mismatch:
    # log pi of the params this step starts from (version `step`: the n-th step's params are version n)
    # vs log mu over the whole batch, split by each token's lag
    lags = jnp.where(versions >= 0, state.step - versions, -1)
    metrics.update(mismatch.mismatch_metrics(logprobs, behaviour, mask, lags))

  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(total_loss) & jnp.isfinite(grad_norm)
  lr = lr_schedule(spec.optimizer)(applied_updates(state.opt_state))
  updates, new_opt_state = spec.tx.update(grads, state.opt_state, state.params)
  new_params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jnp.where(finite, new, old)
  skipped = state.skipped + (~finite).astype(jnp.int32)
  step = state.step + 1
  state = state.replace(params=jax.tree.map(keep, new_params, state.params),
                        opt_state=jax.tree.map(keep, new_opt_state, state.opt_state), step=step, skipped=skipped)
  metrics.update({
      "loss/total": total_loss, "train/grad_norm": grad_norm, "train/lr": lr,
      "train/tokens": jnp.sum(mask).astype(jnp.float32), "train/skipped_nonfinite": skipped,
      "train/step": step, "train/update_applied": finite.astype(jnp.float32),
  })
  return state, metrics


def train_step(spec: StepSpec, state: TrainState, batch: Mapping[str, Array]) -> tuple[TrainState, dict]:
  """One optimizer step on `batch` (the `TRAIN_FIELDS` arrays, `[B, P]` / `[B, R]` / `[B]`): prepare,
  a `lax.scan` of `accumulate` over the microbatches at the full width P + R, apply. Pure: returns
  the next state and the step's scalar metrics."""
  totals = valid_counts(batch["response_mask"])
  micro = split_microbatches(spec, batch)
  compute, frozen, ref_compute = prepare(spec, state)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), compute)
  grads, outs = jax.lax.scan(
      lambda g, xs: accumulate(spec, compute, frozen, ref_compute, g, xs[0], totals,
                               key=dropout_key(spec, state.step, xs[1])),
      zeros, (micro, jnp.arange(spec.microbatches)))
  loss_parts, shares, micro_metrics, logprobs = outs
  state, metrics = apply_update(spec, state, grads, loss_parts, shares, micro_metrics,
                                (logprobs, micro["behaviour_logprobs"], micro["response_mask"],
                                 micro["token_versions"]))
  metrics["train/padding_fraction"] = padding_fraction(batch)
  return state, metrics


# grouped by length: the fused step's parts as separate programs


def row_lengths(batch) -> Array:
  """`[B]` int32, each trainer row's real length (`trainer_layout`)."""
  return trainer_layout(batch["prompt_tokens"], batch["prompt_mask"], batch["response_tokens"],
                        batch["response_mask"])[1]


def prepare_grouped(spec: StepSpec, state: TrainState, batch, order):
  """compute / frozen / ref_compute params, the batch's rows taken in `order` (`[B]`) and split into
  microbatches, the whole batch's normalisers, zero gradients."""
  totals = valid_counts(batch["response_mask"])
  micro = split_microbatches(spec, jax.tree.map(lambda x: jnp.take(x, order, axis=0), batch))
  compute, frozen, ref_compute = prepare(spec, state)
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), compute)
  return compute, frozen, ref_compute, micro, totals, zeros


def accumulate_microbatch(spec: StepSpec, compute, frozen, ref_compute, grads, micro, index, totals, step, *,
                          width):
  """`accumulate` of microbatch `index` at `width` (one program per width)."""
  mb = jax.tree.map(lambda x: x[index], micro)
  return accumulate(spec, compute, frozen, ref_compute, grads, mb, totals, width, dropout_key(spec, step, index))


def apply_grouped(spec: StepSpec, state: TrainState, grads, outs, micro):
  """`apply_update` on the microbatches' `accumulate` outputs (a list of M) stacked as the scan does."""
  loss_parts, shares, micro_metrics, logprobs = jax.tree.map(lambda *x: jnp.stack(x), *outs)
  return apply_update(spec, state, grads, loss_parts, shares, micro_metrics,
                      (logprobs, micro["behaviour_logprobs"], micro["response_mask"], micro["token_versions"]))


def padding_fraction(batch: Mapping[str, Array]) -> Array:
  """Padded positions of the trainer's rows per real token: (B * (P + R) - sum of row lengths) / sum
  of row lengths, rows as `trainer_layout` lays them out (real prompt + response up to its end)."""
  real = jnp.sum(row_lengths(batch)).astype(jnp.float32)
  return (batch["prompt_tokens"].size + batch["response_tokens"].size - real) / real

