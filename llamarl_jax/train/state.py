"""The trainer's state as a value: `TrainState`, and the optimizer that updates it.

A `TrainState` is a pytree (`flax.struct.dataclass`): what is trained (the policy's fp32 params, or
its LoRA adapters), the optimizer state, the step and skipped-step counters, and what is held fixed
(the LoRA policy's frozen base, the KL reference policy). The pure step functions of
`llamarl_jax.train.step` map a state and a batch to the next state; the executor only places states
on its mesh.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from llamarl_jax.config import OptimizerConfig

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  """params: the trained fp32 params (the model's `split_params` dict, or LoRA adapters); opt_state:
  `make_optimizer`'s state of them; step: updates attempted (the next step's policy version), int32
  scalar; skipped: steps whose loss or gradient norm was not finite (no update applied); base: a
  LoRA policy's frozen base in its dtype (None without LoRA); ref: the KL reference policy in the
  compute dtype (None without a KL penalty)."""

  params: Any
  opt_state: Any
  step: Array
  skipped: Array
  base: Any = None
  ref: Any = None

  @property
  def trained(self) -> "TrainState":
    """This state without its frozen parts (base, ref): what a step updates (and may donate)."""
    return self.replace(base=None, ref=None)


def init_state(params, tx: optax.GradientTransformation, *, base=None, ref=None) -> TrainState:
  """A state at step 0: `params` (fp32) with a fresh optimizer state."""
  zero = jnp.zeros((), jnp.int32)
  return TrainState(params=params, opt_state=tx.init(params), step=zero, skipped=zero, base=base, ref=ref)


def state_dict(state: TrainState) -> dict:
  """A state's checkpointable arrays: params, opt_state, step, skipped_nonfinite, and ref_params /
  base_params when it holds them (`placement.restore_state` puts them back)."""
  out = {"params": state.params, "opt_state": state.opt_state, "step": state.step, "skipped_nonfinite": state.skipped}
  out.update({k: v for k, v in (("ref_params", state.ref), ("base_params", state.base)) if v is not None})
  return out


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


def applied_updates(opt_state) -> Array:
  """The schedule's count (updates applied so far) inside an optax state built by `make_optimizer`."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
  if len(found) != 1:
    raise ValueError(f"expected one ScaleByScheduleState in the optimizer state, found {len(found)}")
  return found[0].count
