"""The generator's fp8 weights: float8_e4m3fn projections with one fp32 scale per output channel.

Quantised: every projection of a layer (wq, wk, wv, wo, w_gate, w_up, w_down and the serving layout's
fused wqkv, w_gate_up). Not quantised: embeddings, norms, biases, a MoE layer's router and, by
default, the lm_head (generator dtype). A projection `w` `[*in, *out]` becomes `w` in float8_e4m3fn
and `w_scale` `[*out]` fp32 with `w ~= w_fp8 * w_scale` (amax over the input axes / 448, e4m3's
largest finite value).

A MoE layer's experts (`EXPERTS`: w_gate, w_up `[X, E, F]`, the fused w_gate_up `[X, E, 2, F]`,
w_down `[X, F, E]`) are quantised per expert and output channel: `w_scale` `[X, *out]` (amax over
the one input axis, axis 1), so the scales shard over `expert` like the weights. The grouped matmul
is weight-only fp8 (`model.moe.ScaledExperts`): the rows stay in the compute dtype, each expert's fp8
values are cast to it (exactly: e4m3 has 4 significant bits) and each row's product is multiplied by
its expert's scales, so a MoE layer computes the de-quantised experts' SwiGLU up to summation order.

The fp8 lm_head (`quantize_params(..., lm_head=True)`, `GeneratorConfig.quantize = 'fp8+lm_head'`): the leaf
`lm_head` `[embed, vocab]` in float8_e4m3fn and `lm_head_scale` `[vocab]` (one scale per vocabulary
row), the logits an fp8 GEMM like every projection's. With tied embeddings it is a separate fp8 copy
of the embedding's transpose, used only for the logits; the embedding lookup keeps `embed` in the
generator dtype. It is the largest single read of a small model's decode step (Llama-3.2-1B: 263M
of its 1.24B parameters).

Per output channel, not per block of 128: the scale of an output column is a factor of that column
of the product (`x @ (q * s) = (x @ q) * s`), so one fp8 GEMM per projection computes it and the
scales apply in its epilogue; a block scale varies along the contraction and would need a GEMM per
block of 128 inputs (or a block-scaled kernel XLA does not emit). It also commutes with the serving
layout's fusion (Q/K/V and gate/up concatenate output columns), so the trainer can quantise the
Hugging Face layout before the wire and the generator fuses fp8 values and scales as they are.
BENCHMARKS.md ("The generator in fp8") has the measured error of both choices.

Activations are quantised per token (one scale per row of `x`, amax / 448) inside `dense`: a row's
result depends on that row alone, so a token's log-prob is the same whatever else shares its batch
(slot engine vs static sampler, prefill vs decode, a teacher-forced forward), which a per-tensor
scale would break. `dense` is the W8A8 product: one dot of float8_e4m3fn operands accumulated in
fp32, the row and column scales multiplied after it. Compiled for an H100 it is an fp8 GEMM (a
Triton GEMM fusion whose dot takes both operands in f8e4m3fn; XLA's cuBLASLt fp8 call,
`__cublas$lt$matmul$f8`, would need the weight stored [out, in]); a CPU converts the operands to
fp32, exactly, so it computes the numbers a GPU does up to the GEMM's summation order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

Array = jax.Array

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# projection name -> its number of input (contracted) axes; per module of a layer
INPUT_AXES = {"attn": {"wq": 1, "wk": 1, "wv": 1, "wqkv": 1, "wo": 2},
              "mlp": {"w_gate": 1, "w_up": 1, "w_gate_up": 1, "w_down": 1}}
SCALE = "_scale"  # w's scale is the leaf `w + SCALE` beside it
# a MoE layer's expert weights `[X, *in, *out]` (one input axis), quantised per (expert, output channel)
EXPERTS = ("w_gate", "w_up", "w_gate_up", "w_down")
HEAD = "lm_head"  # the output projection's leaf (top level of a `split_params` dict)


class Rows(NamedTuple):
  """Activations quantised per row: values float8_e4m3fn `[..., K]`, scales fp32 `[...]` (x ~=
  values * scale[..., None]); an input `dense` takes as it is."""

  values: Array
  scale: Array


class Product(NamedTuple):
  """An fp8 GEMM's result before its scales (`dense_unscaled`): y fp32 `[..., *out]`, the input's
  row scales `[...]`, the weight's column scales `[*out]`; its value is `apply_scales`."""

  y: Array
  row: Array
  col: Array

  def value(self, dtype) -> Array:
    return apply_scales(self.y, self.row, self.col, dtype)


def contracted(n_in: int, experts: bool = False) -> tuple[int, ...]:
  """The axes of a weight its scale reduces over: the n_in input axes, after the expert axis when
  `experts` (`[X, *in, *out]`: scales `[X, *out]`)."""
  return tuple(range(int(experts), int(experts) + n_in))


def scale_of(axes: tuple, n_in: int, experts: bool = False) -> tuple:
  """A weight's shape, sharding spec or logical axes (`axes`, one entry per axis) -> its scale's:
  the contracted axes dropped."""
  drop = contracted(n_in, experts)
  return tuple(a for j, a in enumerate(axes) if j not in drop)


def quantize_weight(w: Array, n_in: int, experts: bool = False) -> tuple[Array, Array]:
  """w `[*in, *out]` (n_in input axes) -> (float8_e4m3fn values `[*in, *out]`, fp32 scales `[*out]`),
  w ~= values * scales; an all-zero column gets scale 1. experts: w `[X, *in, *out]`, each expert
  quantised alone, scales `[X, *out]`."""
  w = w.astype(jnp.float32)
  axes = contracted(n_in, experts)
  scale = jnp.max(jnp.abs(w), axis=axes) / E4M3_MAX
  scale = jnp.where(scale == 0, 1.0, scale)
  return (w / jnp.expand_dims(scale, axes)).astype(FP8), scale


def quantize_rows(x: Array) -> tuple[Array, Array]:
  """x `[..., K]` -> (float8_e4m3fn `[..., K]`, fp32 scales `[..., 1]`): one scale per row (token)."""
  xf = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / E4M3_MAX
  scale = jnp.where(scale == 0, 1.0, scale)
  return (xf / scale).astype(FP8), scale


def dense(x: Array | Rows, w: Array, scale: Array, dtype=None) -> Array:
  """x `[..., K]` times fp8 w `[*in, *out]` (prod(in) = K) with per-output-channel `scale` `[*out]`:
  x quantised per row to fp8 (or given so, `Rows`), one fp8 x fp8 dot accumulated in fp32, then
  scaled by x's row scales and w's column scales. Returns `[..., *out]` in `dtype` (default x's)."""
  y, sx = dense_unscaled(x, w)
  return apply_scales(y, sx, scale, x.dtype if dtype is None else dtype)


def dense_unscaled(x: Array | Rows, w: Array) -> tuple[Array, Array]:
  """`dense`'s product before its scales: (y fp32 `[..., *out]`, x's row scales fp32 `[...]`), with
  dense(x, w, scale) == apply_scales(y, row scales, scale, x.dtype). A consumer that reads the fp32
  product itself (the paged decode kernel's keys and values) scales it where it reads it. x: an
  array (quantised here, `quantize_rows`) or `Rows` already quantised (`fp8_kernels`)."""
  given = isinstance(x, Rows)
  K, lead = (x.values if given else x).shape[-1], (x.values if given else x).shape[:-1]
  n_in, size = 0, 1
  while size < K:
    size *= w.shape[n_in]
    n_in += 1
  if size != K:
    raise ValueError(f"fp8 weight {w.shape} has no leading axes of {K} inputs (x {(*lead, K)})")
  out = w.shape[n_in:]
  xq, sx = (x.values.reshape(-1, K), x.scale.reshape(-1, 1)) if given else quantize_rows(x.reshape(-1, K))
  # f8e4m3fn x f8e4m3fn -> fp32, the scales outside the dot: a GPU compiles it as an fp8 GEMM, a CPU
  # converts both operands to fp32 (exactly: e4m3 has 4 significant bits) and runs an fp32 dot
  y = jax.lax.dot_general(xq, w.reshape(K, -1), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return y.reshape(*lead, *out), sx.reshape(lead)


def apply_scales(y: Array, row_scale: Array, scale: Array, dtype) -> Array:
  """y `[..., *out]` fp32 times the row scales `[...]`, then the column scales `[*out]`, in `dtype`."""
  rows = row_scale.reshape(*row_scale.shape, *([1] * scale.ndim))
  return (y * rows * scale).astype(dtype)


def projections(layer: dict):
  """(module, name, n_in) of the projections a layer dict holds, a MoE layer's experts not among them
  (`quantized`: both)."""
  return [(m, k, n) for m, k, n, experts in quantized(layer) if not experts]


def quantized(layer: dict):
  """(module, name, n_in, experts) of the weights of a layer dict that fp8 quantises: the projections,
  and for a MoE layer (a `router` in its mlp) the experts (`EXPERTS`, experts=True; the router stays)."""
  moe = "router" in layer.get("mlp", {})
  return [(m, k, n, moe and m == "mlp" and k in EXPERTS) for m, names in INPUT_AXES.items()
          for k, n in names.items() if k in layer.get(m, {})]


def is_quantized(params: dict) -> bool:
  """Whether a `split_params` dict holds fp8 projections (read from its first layer)."""
  layer = params["layers"][min(params["layers"])]
  return any(k.endswith(SCALE) for m in ("attn", "mlp") for k in layer[m])


def has_fp8_head(params: dict) -> bool:
  """Whether a `split_params` dict holds the fp8 lm_head (`lm_head` + `lm_head_scale`)."""
  return HEAD + SCALE in params


def quantize_head(params: dict) -> tuple[Array, Array]:
  """The lm_head of a `split_params` dict (unquantised) in fp8: (float8_e4m3fn values `[embed, vocab]`,
  fp32 scales `[vocab]`, one per vocabulary row); from the embedding's transpose where the embeddings
  are tied (no `lm_head` leaf). Pure, jittable."""
  if HEAD in params:
    w = params[HEAD]
  elif "score" in params:
    raise ValueError("a score-head model (a `score` leaf, num_labels >= 1) has no lm_head to quantise; serve it "
                     "with GeneratorConfig.quantize = 'fp8' (its lm_head in the generator dtype)")
  else:
    w = params["embed"].T
  return quantize_weight(w, 1)


def with_fp8_head(params: dict) -> dict:
  """`params` with the fp8 lm_head (`quantize_head`) in place of the lm_head in its dtype (tied: beside
  the embedding, which stays); every other leaf the same object. Pure, jittable."""
  values, scale = quantize_head(params)
  return {**{k: v for k, v in params.items() if k != HEAD}, HEAD: values, HEAD + SCALE: scale}


def quantize_params(params: dict, dtype=None, *, lm_head: bool = False) -> dict:
  """A `split_params` dict (any layout, unquantised) -> the same tree with each layer's projections
  in fp8 plus their `_scale` leaves; every other leaf cast to `dtype` (None: as it is). lm_head: the
  lm_head in fp8 too (`with_fp8_head`; tied embeddings: an fp8 copy beside `embed`). Pure, jittable."""
  cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
  out = {k: jax.tree.map(cast, v) for k, v in params.items() if k != "layers" and not (lm_head and k == HEAD)}
  if lm_head:
    out[HEAD], out[HEAD + SCALE] = quantize_head(params)
  layers = {}
  for i, layer in params["layers"].items():
    new = jax.tree.map(cast, layer)
    for m, name, n_in, experts in quantized(layer):
      new[m][name], new[m][name + SCALE] = quantize_weight(layer[m][name], n_in, experts)
    layers[i] = new
  return {**out, "layers": layers}


def dequantize_params(params: dict, dtype=jnp.float32) -> dict:
  """The weights fp8 params stand for: each projection `values * scale` in `dtype`, the scales
  dropped (the unquantised layout; an fp8 lm_head becomes `lm_head` `[embed, vocab]`, also where the
  embeddings are tied); other leaves cast to `dtype`."""
  dtype = jnp.dtype(dtype)
  out = {k: jax.tree.map(lambda x: x.astype(dtype), v) for k, v in params.items()
         if k != "layers" and k != HEAD + SCALE}
  if has_fp8_head(params):
    out[HEAD] = (params[HEAD].astype(jnp.float32) * params[HEAD + SCALE]).astype(dtype)
  layers = {}
  for i, layer in params["layers"].items():
    new = {m: {k: jax.tree.map(lambda x: x.astype(dtype), v) for k, v in layer[m].items() if not k.endswith(SCALE)}
           for m in layer}
    for m, name, n_in, experts in quantized(layer):
      scale = jnp.expand_dims(layer[m][name + SCALE], contracted(n_in, experts))
      new[m][name] = (layer[m][name].astype(jnp.float32) * scale).astype(dtype)
    layers[i] = new
  return {**out, "layers": layers}


def _with_scales(tree: dict, scale) -> dict:
  layers = {}
  for i, layer in tree["layers"].items():
    new = {m: dict(v) for m, v in layer.items()}
    for m, name, n_in, experts in quantized(layer):
      new[m][name + SCALE] = scale(layer[m][name], n_in, experts)
    layers[i] = new
  return {**tree, "layers": layers}


def quantized_shapes(shapes: dict, dtype, *, lm_head: bool = False) -> dict:
  """`ShapeDtypeStruct`s of `quantize_params(params, dtype, lm_head=lm_head)` for params of `shapes`
  (unquantised)."""
  dtype = jnp.dtype(dtype)
  rest = {k: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), v) for k, v in shapes.items() if k != "layers"}
  if lm_head:
    V, E = shapes["embed"].shape
    rest[HEAD], rest[HEAD + SCALE] = jax.ShapeDtypeStruct((E, V), FP8), jax.ShapeDtypeStruct((V,), jnp.float32)
  layers = {}
  for i, layer in shapes["layers"].items():
    new = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), layer)
    for m, name, n_in, experts in quantized(layer):
      w = layer[m][name]
      new[m][name] = jax.ShapeDtypeStruct(w.shape, FP8)
      new[m][name + SCALE] = jax.ShapeDtypeStruct(scale_of(w.shape, n_in, experts), jnp.float32)
    layers[i] = new
  return {**rest, "layers": layers}


def quantized_shardings(shardings: dict, *, lm_head: bool = False) -> dict:
  """The shardings of `quantize_params(..., lm_head=lm_head)`'s output given the unquantised params'
  (`NamedSharding`s): each scale shards like its projection's output axes (an expert's: its expert
  and output axes); a tied model's fp8 lm_head like the embedding's transpose."""
  def scale(s: NamedSharding, n_in: int, experts: bool = False) -> NamedSharding:
    spec = tuple(s.spec) + (None,) * (n_in + int(experts) - len(s.spec))
    return NamedSharding(s.mesh, P(*scale_of(spec, n_in, experts)))
  out = _with_scales(shardings, scale)
  if lm_head:
    if HEAD in shardings:
      head = shardings[HEAD]
    else:
      embed = shardings["embed"]
      vocab, dim = (tuple(embed.spec) + (None, None))[:2]
      head = NamedSharding(embed.mesh, P(dim, vocab))
    out = {**out, HEAD: head, HEAD + SCALE: scale(head, 1)}
  return out
