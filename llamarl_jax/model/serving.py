"""The generator's serving layout: fused Q/K/V and gate/up projections, built from the trainer's layout.

A decode step runs one input GEMM per attention block instead of three and one per MLP instead of
two (`WeightLayout`, `llama.py`'s module docstring for the shapes). The trainer, checkpoints, exports
and the weight push keep Hugging Face's layout (LoRA adapts and merges the unfused projections); the
generator fuses what arrives, on its own devices (`Sampler.place_params`), before its programs run.

Q/K/V are fused per KV head: wqkv[:, j] = [wq's heads j*G .. (j+1)*G - 1, wk[:, j], wv[:, j]] with
G = heads / kv_heads, so a shard over `kv_heads` (tensor parallelism) holds exactly the q, k and v
columns of its own heads, and the fused matrix shards like its parts (`serving_layout` fuses Q/K/V
only where the parts' `heads` and `kv_heads` shard alike). Gate/up stack on a middle axis of 2, so
`mlp` shards as before. Fusing moves values only: the serving model computes each output column from
the same weights; only GEMM shapes (and so, on some backends, summation blocking) change.

fp8 weights (`WeightLayout.fp8`, `model.fp8`) fuse as they are: a scale per output column is a
column's own, so the fused matrix's values and scales are the parts' values and scales, placed as
the columns are (`fuse` treats `wq_scale` [heads, head_dim] like the bias bq). An fp8 lm_head
(`WeightLayout.fp8_lm_head`) is not fused with anything: `lm_head` + `lm_head_scale` as quantised.
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
from jax.sharding import Mesh

from llamarl_jax import parallel
from llamarl_jax.model import fp8
from llamarl_jax.model.config import ModelConfig, WeightLayout

# fused name -> the unfused parts it replaces, per module of a layer
# (fp8 weights: their per-output-channel scales fuse like the values, `model.fp8`)
FUSED_QKV = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"),
             "wqkv_scale": ("wq_scale", "wk_scale", "wv_scale")}
FUSED_MLP = {"w_gate_up": ("w_gate", "w_up"), "w_gate_up_scale": ("w_gate_scale", "w_up_scale")}


def serving_layout(config: ModelConfig, mesh: Mesh, rules: Mapping[str, str | None] = parallel.RULES, *,
                   quantize: str | None = None) -> WeightLayout:
  """The generator's layout on `mesh`: gate/up fused always; Q/K/V fused where `heads` and
  `kv_heads` shard over the same mesh axis (or neither shards), so the fused matrix loses no
  sharding (e.g. 2 KV heads on tp=4: the parts stay separate, q sharded, k and v replicated).
  quantize: the weights' precision (`model.config.QUANTIZATIONS`, `model.fp8`). An exact model
  (`ModelConfig.exact`) serves Hugging Face's projections unfused."""
  if config.exact:  # batch-invariant ops need the trainer's projections (a fused column sums differently)
    return WeightLayout(quantize=quantize)
  heads = parallel.logical_to_spec(("heads",), (config.num_heads,), mesh, rules)
  kv_heads = parallel.logical_to_spec(("kv_heads",), (config.num_kv_heads,), mesh, rules)
  return WeightLayout(fused_qkv=heads == kv_heads, fused_mlp=True, quantize=quantize)


def _fusions(layout: WeightLayout) -> dict[str, dict[str, tuple[str, ...]]]:
  return {"attn": FUSED_QKV if layout.fused_qkv else {}, "mlp": FUSED_MLP if layout.fused_mlp else {}}


def params_layout(params: dict) -> WeightLayout:
  """The layout a `split_params` dict is in (read from its first layer's names and the fp8 lm_head's scale)."""
  layer = params["layers"][min(params["layers"])]
  projections_fp8, head_fp8 = "wo_scale" in layer["attn"], fp8.has_fp8_head(params)
  if head_fp8 and not projections_fp8:
    raise ValueError("params hold an fp8 lm_head beside projections in their dtype, a precision no generator "
                     "holds; quantise the projections too (`fp8.quantize_params(..., lm_head=True)`)")
  return WeightLayout(fused_qkv="wqkv" in layer["attn"], fused_mlp="w_gate_up" in layer["mlp"],
                      quantize=("fp8+lm_head" if head_fp8 else "fp8") if projections_fp8 else None)


def fusion_inputs(params: dict, layout: WeightLayout) -> dict:
  """The unfused parts `layout` fuses, per layer: {i: {"attn": {"wq", "wk", "wv"(, biases)}, "mlp":
  {"w_gate", "w_up"}}} (a sub-tree of `params`, the trainer's layout)."""
  return {i: {m: {p: layer[m][p] for parts in f.values() for p in parts if p in layer[m]}
              for m, f in _fusions(layout).items()}
          for i, layer in params["layers"].items()}


def fuse(inputs: dict) -> dict:
  """`fusion_inputs` -> the fused matrices {i: {"attn": {"wqkv"(, "bqkv")}, "mlp": {"w_gate_up"}}} (pure).

  wq [E, H, D], wk, wv [E, KV, D] -> wqkv [E, KV, H/KV + 2, D] (biases: the same without E);
  w_gate, w_up [E, F] -> w_gate_up [E, 2, F]."""
  def qkv(q, k, v):
    *lead, H, D = q.shape
    KV = k.shape[-2]
    return jnp.concatenate([q.reshape(*lead, KV, H // KV, D), k[..., None, :], v[..., None, :]], axis=-2)

  out = {}
  for i, layer in inputs.items():
    attn, mlp = layer["attn"], layer["mlp"]
    out[i] = {"attn": {}, "mlp": {}}
    if "wq" in attn:
      out[i]["attn"]["wqkv"] = qkv(attn["wq"], attn["wk"], attn["wv"])
    if "bq" in attn:
      out[i]["attn"]["bqkv"] = qkv(attn["bq"], attn["bk"], attn["bv"])
    if "wq_scale" in attn:
      out[i]["attn"]["wqkv_scale"] = qkv(attn["wq_scale"], attn["wk_scale"], attn["wv_scale"])
    if "w_gate" in mlp:
      out[i]["mlp"]["w_gate_up"] = jnp.stack([mlp["w_gate"], mlp["w_up"]], axis=-2)
    if "w_gate_scale" in mlp:
      out[i]["mlp"]["w_gate_up_scale"] = jnp.stack([mlp["w_gate_scale"], mlp["w_up_scale"]], axis=-2)
  return out


def fused_part(serving: dict) -> dict:
  """The fused leaves of a serving-layout tree (params or their shardings), shaped like `fuse`'s output."""
  names = {**FUSED_QKV, **FUSED_MLP}
  return {i: {m: {k: v for k, v in layer[m].items() if k in names} for m in ("attn", "mlp")}
          for i, layer in serving["layers"].items()}


def with_fused(params: dict, fused: dict, layout: WeightLayout) -> dict:
  """`params` (trainer's layout) with the parts `layout` fuses replaced by `fused` (`fuse`'s output);
  every other leaf is the same object."""
  drop = {m: {p for parts in f.values() for p in parts} for m, f in _fusions(layout).items()}
  layers = {}
  for i, layer in params["layers"].items():
    layers[i] = dict(layer)
    for m in ("attn", "mlp"):
      layers[i][m] = {**{k: v for k, v in layer[m].items() if k not in drop[m]}, **fused[i][m]}
  return {**params, "layers": layers}


def serving_params(params: dict, layout: WeightLayout) -> dict:
  """The serving layout of `params` (a `split_params` dict in the trainer's layout): the same
  weights, Q/K/V and gate/up fused as `layout` says, with `layout.fp8` their projections quantised
  first (`fp8.quantize_params`; params already in fp8 are fused as they are), with
  `layout.fp8_lm_head` the lm_head too (`fp8.with_fp8_head`, where not yet). Jittable; `HF_LAYOUT`
  returns `params`."""
  if layout.fp8 and not fp8.is_quantized(params):
    params = fp8.quantize_params(params)
  if layout.fp8_lm_head and not fp8.has_fp8_head(params):
    params = fp8.with_fp8_head(params)
  if not (layout.fused_qkv or layout.fused_mlp):
    return params
  return with_fused(params, fuse(fusion_inputs(params, layout)), layout)
