"""Weight sync, the DDMA analogue: trainer params -> generator layout, device to device.

`push` casts the trainer's params to the generator dtype on the trainer mesh (so half the bytes move
for fp32 -> bf16), then reshards them onto the generator's shardings with `jax.device_put`: XLA moves
the shards device to device (NVLink / ICI on accelerators); nothing goes through host numpy.

With `quantize="fp8"` each layer's projections are quantised on the trainer mesh to float8_e4m3fn
with an fp32 scale per output channel (`model.fp8.quantize_params`); embeddings, norms, biases and
the lm_head are cast to the generator dtype (with `quantize="fp8+lm_head"` the lm_head is quantised
too, a scale per vocabulary row; tied embeddings: an fp8 copy crosses beside the embedding, +1 byte
per embedding weight on the wire). The fp8 values and scales are what crosses the meshes
(the projections at half of bf16's bytes) and what the generator keeps: its sampler fuses them into
the serving layout as they are and computes with fp8 GEMMs, never de-quantising a weight. The
generator then samples from a slightly different policy than the trainer's, which is exactly the
mismatch AIPO's importance weights correct (visible in `policy/ratio_*` and `rollout_corr/*`).

LoRA (`adapter_shardings`): a push moves only the fp32 adapters (`sync/bytes`); the generator holds
the frozen base in its dtype (moved once, and again only when the trainer's base changes: a warm
start, a restore; `sync/base_bytes` in that push) and builds each version on its own devices by
merging, `w + alpha / rank * a @ b` summed in fp32 and cast to its dtype (`lora.merge_adapters`);
with fp8 the merged weights are quantised there, in the same program.
Merged serving, as verl's and vLLM-style engines do it: the decode step and its programs are the
ones of full fine-tuning (no low-rank matmuls per token), at the cost of one merge per version.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax.metrics import append_bounded
from llamarl_jax.model import fp8
from llamarl_jax.model.config import WeightLayout
from llamarl_jax.model.lora import merge_adapters


def tree_bytes(tree: Any) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


class WeightSync:
  """Holds the generator's weights by policy version; thread-safe.

  gen_shardings: pytree of `NamedSharding` on the generator mesh (same structure as params).
  dtype: the generator's parameter dtype (e.g. bfloat16).
  quantize: the versions' precision (`model.config.QUANTIZATIONS`): None, or 'fp8' / 'fp8+lm_head'
    (the versions held are then `fp8.quantize_params` trees, the lm_head quantised too with
    'fp8+lm_head'; their shardings `fp8.quantized_shardings(gen_shardings)`: `self.out_shardings`).
    `self.layout`: the versions' layout (Hugging Face's projections in this precision).
  keep_pending: keep every pushed version until the generator `take`s it or a newer one (the 'fixed'
    schedule asks for exact versions; at most max_policy_lag + 1 copies wait on the generator mesh).
    False keeps only the newest (the 'latest' schedule).
  adapter_shardings: LoRA: the adapters' shardings on the generator mesh (`lora.adapter_axes`); what is
    pushed is then the adapters, merged with `base()` (a callable returning the trainer's frozen base,
    generator dtype) times `lora_scale` (alpha / rank).
  """

  def __init__(self, gen_shardings: Any, dtype=jnp.bfloat16, quantize: str | None = None,
               keep_pending: bool = False, adapter_shardings: Any = None,
               lora_scale: float = 1.0, base: Any = None):
    self.layout = WeightLayout(quantize=quantize)
    if adapter_shardings is not None and base is None:
      raise ValueError("a LoRA WeightSync (adapter_shardings) needs base, a callable returning the frozen base")
    self.gen_shardings = gen_shardings
    head = dict(lm_head=self.layout.fp8_lm_head)
    self.out_shardings = fp8.quantized_shardings(gen_shardings, **head) if self.layout.fp8 else gen_shardings
    self.dtype = jnp.dtype(dtype)
    self.keep_pending = keep_pending
    self._cond = threading.Condition()
    self._versions: dict[int, Any] = {}  # policy version -> generator params
    self._closed = False
    self.history: list[dict] = []  # per push: seconds, bytes, gbps
    self._cast = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(self.dtype), p))
    self._quant = jax.jit(lambda p: fp8.quantize_params(p, self.dtype, **head))
    self.adapter_shardings, self._base_fn = adapter_shardings, base
    self._base_source = self._base = None  # the trainer's base tree last moved, and its generator copy
    finish = (lambda p: fp8.quantize_params(p, **head)) if self.layout.fp8 else (lambda p: p)
    self._merge = jax.jit(lambda base, adapters: finish(merge_adapters(base, adapters, lora_scale, self.dtype)),
                          out_shardings=self.out_shardings)

  @property
  def lora(self) -> bool:
    return self.adapter_shardings is not None

  def version_layout(self, model_shapes: Any) -> Any:
    """A version as the generator holds it (and a checkpoint keeps it), as sharded
    `ShapeDtypeStruct`s: `model_shapes` (the trainer's params) in this sync's dtype and precision."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, self.dtype), model_shapes)
    if self.layout.fp8:
      shapes = fp8.quantized_shapes(model_shapes, self.dtype, lm_head=self.layout.fp8_lm_head)
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, self.out_shardings)

  def _generator_base(self) -> int:
    """LoRA: move the trainer's base to the generator if it is not the tree moved last; its bytes (0: held)."""
    base = self._base_fn()
    if base is self._base_source:
      return 0
    self._base = jax.device_put(self._cast(base), self.gen_shardings)
    self._base_source = base
    return tree_bytes(self._base)

  def wire(self, params: Any) -> tuple[Any, Any]:
    """What a push moves for `params` (trainer mesh): the tree cast to the generator dtype (fp8: the
    projections quantised, `fp8.quantize_params`), still on the trainer's devices, and the
    generator-mesh shardings it is `device_put` into."""
    if self.lora:
      return params, self.adapter_shardings
    if self.layout.fp8:
      return self._quant(params), self.out_shardings
    return self._cast(params), self.gen_shardings

  def to_generator(self, params: Any) -> tuple[Any, int]:
    """`params` (trainer mesh) cast/quantised and resharded to the generator layout, and the bytes moved.

    Registers nothing: `push` does that; evaluation uses this directly so that it never disturbs the
    versions the generator is waiting for. LoRA: `params` are the adapters, merged on the generator
    (the bytes are the adapters'; a base moved on the way is `_generator_base`'s).
    """
    gen_params, nbytes, _ = self._to_generator(params)
    return gen_params, nbytes

  def _to_generator(self, params: Any) -> tuple[Any, int, int]:
    base_bytes = self._generator_base() if self.lora else 0
    tree, shardings = self.wire(params)
    moved = jax.device_put(tree, shardings)
    if self.lora:
      return self._merge(self._base, moved), tree_bytes(moved), base_bytes
    return moved, tree_bytes(moved), base_bytes

  def push(self, params: Any, version: int) -> dict:
    """Cast/quantise `params` (trainer mesh) and reshard to the generator; returns timing metrics
    (LoRA: `params` are the adapters; `sync/base_bytes` when the base moved too)."""
    start = time.perf_counter()
    gen_params, nbytes, base_bytes = self._to_generator(params)
    jax.block_until_ready(gen_params)
    seconds = time.perf_counter() - start
    metrics = {"sync/seconds": seconds, "sync/bytes": float(nbytes),
               "sync/gbps": (nbytes + base_bytes) / max(seconds, 1e-9) / 1e9, "sync/version": float(version)}
    if base_bytes:
      metrics["sync/base_bytes"] = float(base_bytes)
    with self._cond:
      self._versions[int(version)] = gen_params
      if not self.keep_pending:
        self._drop_below(int(version))
      append_bounded(self.history, metrics)
      self._cond.notify_all()
    return metrics

  def insert(self, gen_params: Any, version: int) -> None:
    """Hold `gen_params` as policy `version` as they are: already in the generator's layout and dtype
    (e.g. restored from a checkpoint, for an exact resume of the 'fixed' schedule). Nothing is cast."""
    with self._cond:
      self._versions[int(version)] = gen_params
      self._cond.notify_all()

  def _drop_below(self, version: int) -> None:
    for v in [v for v in self._versions if v < version]:
      del self._versions[v]

  def latest(self) -> tuple[Any, int]:
    """(params, version) of the newest push; (None, -1) before the first."""
    with self._cond:
      v = self._newest()
      return self._versions.get(v), v

  def take(self, version: int, timeout: float | None = None) -> tuple[Any, int] | None:
    """Block until exactly `version` was pushed; return (params, version) and drop older versions.

    None on close()/timeout. Raises if a newer version exists but `version` is gone (it was dropped:
    the caller asked out of order, which the 'fixed' schedule never does).
    """
    with self._cond:
      self._cond.wait_for(lambda: self._closed or version in self._versions
                          or self._newest() > version, timeout)
      if version not in self._versions:
        if self._newest() > version:
          raise ValueError(f"policy version {version} was asked for but is no longer held (held: "
                           f"{sorted(self._versions)}); versions must be taken in increasing order")
        return None
      self._drop_below(version)
      return self._versions[version], version

  def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
    """Block until a push with version >= `version` (True) or close()/timeout (False)."""
    with self._cond:
      self._cond.wait_for(lambda: self._closed or self._newest() >= version, timeout)
      return self._newest() >= version

  def _newest(self) -> int:
    return max(self._versions, default=-1)

  @property
  def version(self) -> int:
    """The newest pushed policy version (-1 before the first push)."""
    with self._cond:
      return self._newest()

  def close(self) -> None:
    """Wake every `wait_for_version` waiter (they return False) and keep them from blocking again."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def drop_pending(self) -> None:
    """Keep only the newest version (between runs: versions nobody will take free their memory)."""
    with self._cond:
      self._drop_below(self._newest())

  def clear(self) -> None:
    """Drop every held version (after a checkpoint restore they belong to another timeline: a version
    number is pushed again with other weights)."""
    with self._cond:
      self._versions.clear()

  def reopen(self) -> None:
    """Undo `close` (the controller reopens between `run` calls); the weights are kept."""
    with self._cond:
      self._closed = False
