"""The train step's device programs on a trainer mesh, and the host side of its three layouts.

`TrainPrograms(spec, placement, ...)` jits the pure step functions of `train.step` and `train.packed`
with explicit shardings, the trained state donated and the frozen parts (the LoRA base, the KL
reference) passed beside it. `run(state, batch)` trains one batch in the spec's layout
(`StepSpec.layout`, a `TrainLayout`):

  padded (default):  one program, `train_step`: every microbatch at the batch's width P + R;
  grouped:           the rows' lengths to the host (one `[B]` transfer), `layout.group_by_length`,
                     then prepare, one accumulation per microbatch at its width (a program per width),
                     apply;
  packed:            the lengths to the host, `layout.pack_rows` into rows of `StepSpec.layout.tokens`
                     tokens, then one program, `packed_train_step`, whatever the lengths.

All three give the same loss, gradient and metrics (up to fp32 summation order). Each program is a
jitted function of its own (a jit cache is per function): `trace_count` counts these programs'
compilations from their caches, never from a counter bumped under trace.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import compat, parallel
from llamarl_jax.model import exact, paged_attention
from llamarl_jax.model import lora as lora_lib
from llamarl_jax.train import step as steps
from llamarl_jax.train.layout import group_by_length, pack_rows
from llamarl_jax.train.packed import PLAN_FIELDS, check_token_budget, packed_train_step
from llamarl_jax.train.placement import Placement, abstract_batch, check_batch_size
from llamarl_jax.train.state import TrainState

Array = jax.Array


class TrainPrograms:
  """The jitted step programs of one `StepSpec` on one `Placement`; `run` uses `spec.layout`. with_base /
  with_ref: the states passed in hold a LoRA base / a KL reference (their shardings are fixed here)."""

  def __init__(self, spec: steps.StepSpec, placement: Placement, *, with_base: bool = False,
               with_ref: bool = False):
    self.spec, self.placement, self.layout = spec, placement, spec.layout
    pl, repl, trained_sh = placement, placement.replicated, placement.trained
    frozen_sh = (pl.model if with_base else None, pl.model if with_ref else None)
    with_frozen = lambda fn: lambda trained, frozen, *a: fn(spec, trained.replace(base=frozen[0], ref=frozen[1]), *a)
    on_mesh = lambda fn: exact.traced_on(fn, spec.mesh)  # the exact ops' dense splits rows itself (`model.exact`)
    # exact ops: the GEMMs sum K in one pass, as the decode programs' (`exact.COMPILER_OPTIONS`)
    options = exact.COMPILER_OPTIONS if spec.model.exact else None
    trained_only = lambda fn: lambda *a: (lambda state, metrics: (state.trained, metrics))(*fn(*a))
    self.train_step = jax.jit(on_mesh(trained_only(with_frozen(steps.train_step))), donate_argnums=(0,),
                              compiler_options=options, in_shardings=(trained_sh, frozen_sh, pl.batch),
                              out_shardings=(trained_sh, repl))
    self.packed_step = jax.jit(on_mesh(trained_only(with_frozen(packed_train_step))), donate_argnums=(0,),
                               compiler_options=options, in_shardings=(trained_sh, frozen_sh, pl.batch, repl),
                               out_shardings=(trained_sh, repl))
    # the rows' lengths (grouped and packed layouts)
    self.row_lengths = jax.jit(lambda batch: steps.row_lengths(batch), out_shardings=repl)
    # grouped by length: the fused step's parts as separate programs (see `_grouped`)
    frozen_compute = tuple(None if sh is None else pl.model_compute for sh in frozen_sh)
    self.prepare_step = jax.jit(on_mesh(with_frozen(steps.prepare_grouped)), compiler_options=options,
                                out_shardings=(pl.compute, *frozen_compute, pl.micro, repl, pl.compute))
    self.accumulate_step = jax.jit(on_mesh(functools.partial(steps.accumulate_microbatch, spec)),
                                   compiler_options=options, static_argnames=("width",), donate_argnums=(3,),
                                   out_shardings=(pl.compute, (repl, repl, repl, parallel.batch_sharding(pl.mesh, 2))))
    self.apply_step = jax.jit(functools.partial(steps.apply_grouped, spec), donate_argnums=(0,),
                              out_shardings=(trained_sh, repl))
    self._microbatch_index = None  # [M] replicated int32 scalars, made at the first grouped step
    self.next_step = jax.jit(lambda step: step + 1, out_shardings=repl)
    self.merge = None if spec.lora is None else jax.jit(
        lambda base, adapters: lora_lib.merge_adapters(base, adapters, spec.lora_scale, jnp.float32),
        out_shardings=pl.model)

  @property
  def trace_count(self) -> int:
    """Train-step programs compiled so far (the jit caches' entries)."""
    return sum(compat.jit_cache_size(f) for f in (self.train_step, self.packed_step, self.row_lengths, self.prepare_step,
                                         self.accumulate_step, self.apply_step))

  def run(self, state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict[str, Array], float | None]:
    """One optimizer step of `state` (its trained part donated) on the placed `batch` in this layout.
    Returns the next state, the device metrics and, grouped by length, the host's padding fraction."""
    frozen, padding = (state.base, state.ref), None
    if self.layout.grouped:
      trained, metrics, padding = self._grouped(state, batch)
    elif self.layout.packed:
      trained, metrics = self.packed_step(state.trained, frozen, batch, self._plan(batch))
    else:
      trained, metrics = self.train_step(state.trained, frozen, batch)
    return trained.replace(base=frozen[0], ref=frozen[1]), metrics, padding

  def _plan(self, batch: dict[str, Array]) -> dict[str, Array]:
    """The packed layout's plan: the lengths to the host, `pack_rows`, the plan back, replicated."""
    T = self.layout.tokens
    check_token_budget(batch["prompt_tokens"].shape[1], batch["response_tokens"].shape[1], T)
    plan = pack_rows(parallel.local_value(self.row_lengths(batch)), T, self.spec.shards)
    plan_arrays = {**{k: getattr(plan, k) for k in PLAN_FIELDS}, "microbatches": np.int32(plan.microbatches)}
    return jax.device_put(plan_arrays, self.placement.replicated)

  def _grouped(self, state: TrainState, batch: dict[str, Array]):
    """Lengths to the host, `group_by_length`, then prepare, one accumulation call per microbatch (at
    its width) and apply. Returns the next trained state, the device metrics and the padding fraction."""
    M, repl = self.spec.microbatches, self.placement.replicated
    groups = group_by_length(parallel.local_value(self.row_lengths(batch)), M,
                             batch["prompt_tokens"].shape[1] + batch["response_tokens"].shape[1])
    if self._microbatch_index is None:
      self._microbatch_index = [jax.device_put(np.int32(m), repl) for m in range(M)]
    order = jax.device_put(groups.order, repl)
    compute, frozen, ref_compute, micro, totals, grads = self.prepare_step(state.trained, (state.base, state.ref),
                                                                           batch, order)
    outs = []
    for index, width in zip(self._microbatch_index, groups.widths):
      grads, out = self.accumulate_step(compute, frozen, ref_compute, grads, micro, index, totals, state.step,
                                        width=width)
      outs.append(out)
    del compute, frozen, ref_compute
    trained, metrics = self.apply_step(state.trained, grads, outs, micro)
    return trained, metrics, groups.padding_fraction

  def lower(self, state: TrainState, batch_size: int, prompt_len: int, resp_len: int, platform: str) -> Any:
    """The train step (packed for a packed layout, else the fused padded step: a grouped step's worst case) of
    `state` (arrays or `ShapeDtypeStruct`s) lowered for `platform` from abstract shapes
    (`jax.stages.Lowered`). Nothing is allocated."""
    pl = self.placement
    check_batch_size(pl.mesh, self.spec.microbatches, batch_size)
    shape_of = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    args = [*jax.tree.map(shape_of, (state.trained, (state.base, state.ref))),
            abstract_batch(pl, self.spec.model, batch_size, prompt_len, resp_len)]
    if self.layout.packed:
      plan = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=pl.replicated)
      args.append({**{k: plan for k in PLAN_FIELDS},
                   "microbatches": jax.ShapeDtypeStruct((), jnp.int32, sharding=pl.replicated)})
    own = platform == pl.mesh.devices.flat[0].platform  # else a target topology compiled for here
    fn = self.packed_step if self.layout.packed else self.train_step
    with paged_attention.target_platform(platform):  # Pallas kernels compile for it (not interpreted)
      return fn.trace(*args).lower(lowering_platforms=None if own else (platform,))
