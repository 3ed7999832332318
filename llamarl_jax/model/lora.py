"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the decoder's projections, and PEFT's format.

An adapted projection `w` `[*in, *out]` (our layout, `llama.py`) gets `a` `[*in, rank]` and `b`
`[rank, *out]`; the policy's projection is `w + scale * a @ b` with `scale = alpha / rank`. The
adapters are a pytree shaped like the params, holding only the adapted projections:

  {"layers": {0: {"attn": {"wq": {"a": [E, r], "b": [r, H, D]}, "wo": {"a": [H, D, r], "b": [r, E]}},
                  "mlp": {"w_gate": {"a": [E, r], "b": [r, F]}, "w_down": {"a": [F, r], "b": [r, E]}}}}}

so that `prepare_params` / `unstack_layers` stack and unstack it like the params, and its logical
axes (`adapter_axes`: `a` keeps the input axes of `w`, `b` its output axes, the rank axis
replicated) shard it like the matrix it adapts under FSDP and TP.

A MoE layer's experts (targets 'expert_gate', 'expert_up', 'expert_down') get one adapter per expert:
w_gate, w_up `[X, E, F]` have `a` `[X, E, r]`, `b` `[X, r, F]`; w_down `[X, F, E]` has `a` `[X, F, r]`,
`b` `[X, r, E]` (the expert axis leads both, sharded like the experts), so expert x's weight is
`w[x] + scale * a[x] @ b[x]`. The trainer runs each row's `scale * (x @ a_x) @ b_x` by grouped matmuls
over the rows sorted by expert (`moe.grouped_swiglu`), never merging. At Qwen3-30B-A3B's shapes (X 128,
E 2048, F 768, r 16, a microbatch of 3072 tokens = 24576 rows per device) a merge costs
3 X E F 2 r = 19 GFLOP per layer forward, writes 1.2 GB of merged bf16 experts, and its backward is
the full expert weight gradient (2 rows 3 E F = 232 GFLOP, `[X, E, F]` x 3 in fp32 = 2.4 GB per
layer) that a frozen base never computes; the rows' path is 3 x 2 r (E + F) FLOPs per row (6.6
GFLOP forward, ~20 forward + backward) with `[rows, r]` (2.4 MB) in between. `b` starts at zero (PEFT's
default), so an adapted policy starts exactly equal to its base; `a` starts uniform in
+-1/sqrt(fan_in) (PEFT's kaiming-uniform with a = sqrt(5)).

The trainer adds the low-rank path unmerged (`layers.with_lora`); the generator serves merged weights
(`merge_adapters`). `save_peft_adapter` / `load_peft_adapter` read and write a PEFT adapter directory
(`adapter_config.json` + `adapter_model.safetensors`, tensors `[rank, in]` / `[out, rank]` under
PEFT's names) that `peft.PeftModel.from_pretrained(base, path)` loads. Expert adapters are written as transformers 4
laid Qwen3-MoE out (one Linear per expert: `mlp.experts.{x}.gate_proj.lora_A.weight` `[r, E]`, target
modules 'gate_proj', 'up_proj', 'down_proj'); transformers 5 fuses the experts into `gate_up_proj`
`[X, 2F, E]` and `down_proj` `[X, E, F]` parameters, and PEFT (>= 0.18) converts such an adapter on
load to LoRA of those parameters (gate and up fused: rank 2r, alpha 2 alpha, so it needs
'expert_gate' and 'expert_up' both or neither; tested with peft 0.21, transformers 5.24).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import abstract_model, split_params

# target name -> (module, our parameter, HF / PEFT module name, number of input axes of our layout
# after the expert axis, one adapter per expert: the target adapts a MoE layer's experts)
TARGETS = {
    "q": ("attn", "wq", "self_attn.q_proj", 1, False),
    "k": ("attn", "wk", "self_attn.k_proj", 1, False),
    "v": ("attn", "wv", "self_attn.v_proj", 1, False),
    "o": ("attn", "wo", "self_attn.o_proj", 2, False),
    "gate": ("mlp", "w_gate", "mlp.gate_proj", 1, False),
    "up": ("mlp", "w_up", "mlp.up_proj", 1, False),
    "down": ("mlp", "w_down", "mlp.down_proj", 1, False),
    "expert_gate": ("mlp", "w_gate", "mlp.experts.{x}.gate_proj", 1, True),
    "expert_up": ("mlp", "w_up", "mlp.experts.{x}.up_proj", 1, True),
    "expert_down": ("mlp", "w_down", "mlp.experts.{x}.down_proj", 1, True),
}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def scale(lora) -> float:
  """alpha / rank: the factor of the low-rank update (`lora`: a `config.LoraConfig`)."""
  return lora.alpha / lora.rank


def _model_shapes(config: ModelConfig) -> dict:
  return split_params(abstract_model(config))[1]


def _adapted(config: ModelConfig, lora):
  """(layer, module, our name, HF module name, input axes, weight shape, lead) of every adapted
  projection; lead: 1 for experts (the expert axis leads `w`, `a` and `b`), else 0."""
  shapes = _model_shapes(config)
  for i in range(config.num_layers):
    for t in lora.targets:
      module, name, hf_name, n_in, experts = TARGETS[t]
      if module == "mlp" and experts != config.is_moe_layer(i):
        kind, use = (("a MoE layer", f"'expert_{t}'") if not experts else
                     ("a dense layer", f"'{t.removeprefix('expert_')}'"))
        raise ValueError(f"LoraConfig.targets has {t!r}, but layer {i} of this {config.model_type} model is {kind}: "
                         f"adapt its MLP with {use} (or leave the MLP out of the targets)")
      yield i, module, name, hf_name, n_in, tuple(shapes["layers"][i][module][name].shape), int(experts)


def _ab_shapes(shape: tuple, n_in: int, lead: int, rank: int) -> tuple[tuple, tuple]:
  """`a` `[*lead, *in, r]` and `b` `[*lead, r, *out]` of a weight `[*lead, *in, *out]`."""
  return (*shape[:lead + n_in], rank), (*shape[:lead], rank, *shape[lead + n_in:])


def adapter_shapes(config: ModelConfig, lora) -> dict:
  """The adapters' tree of fp32 `ShapeDtypeStruct`s (see the module docstring)."""
  out: dict = {"layers": {}}
  for i, module, name, _, n_in, shape, lead in _adapted(config, lora):
    a, b = _ab_shapes(shape, n_in, lead, lora.rank)
    out["layers"].setdefault(i, {}).setdefault(module, {})[name] = {"a": jax.ShapeDtypeStruct(a, jnp.float32),
                                                                     "b": jax.ShapeDtypeStruct(b, jnp.float32)}
  return out


def adapter_axes(model_axes: dict, lora) -> dict:
  """Logical axes of the adapters from the model's (`parallel.logical_axes`): `a` the adapted matrix's
  input axes and a replicated rank axis, `b` the rank axis and its output axes."""
  out: dict = {"layers": {}}
  for i in model_axes["layers"]:
    for t in lora.targets:
      module, name, _, n_in, experts = TARGETS[t]
      axes, lead = tuple(model_axes["layers"][i][module][name]), int(experts)
      out["layers"].setdefault(i, {}).setdefault(module, {})[name] = {
          "a": (*axes[:lead + n_in], None), "b": (*axes[:lead], None, *axes[lead + n_in:])}
  return out


def init_adapters(config: ModelConfig, lora, seed: int = 0) -> dict:
  """Initial adapters (numpy fp32): `a` uniform in +-1/sqrt(fan_in), `b` zeros (the policy equals its base)."""
  rng = np.random.default_rng(seed)
  out: dict = {"layers": {}}
  for i, module, name, _, n_in, shape, lead in _adapted(config, lora):
    bound = 1.0 / math.sqrt(math.prod(shape[lead:lead + n_in]))  # fan_in
    a, b = _ab_shapes(shape, n_in, lead, lora.rank)
    out["layers"].setdefault(i, {}).setdefault(module, {})[name] = {
        "a": rng.uniform(-bound, bound, a).astype(np.float32), "b": np.zeros(b, np.float32)}
  return out


def delta(a: jax.Array, b: jax.Array, lead: int = 0) -> jax.Array:
  """`a @ b` in fp32 in the adapted matrix's layout: a `[*lead, *in, r]`, b `[*lead, r, *out]` ->
  `[*lead, *in, *out]` (lead: the leading batch axes, 1 for experts: one product per expert)."""
  rank, batch = a.shape[-1], a.shape[:lead]
  product = jnp.matmul(a.reshape(*batch, -1, rank).astype(jnp.float32),
                       b.reshape(*batch, rank, -1).astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  return product.reshape(*a.shape[:-1], *b.shape[lead + 1:])


def merge_adapters(params: dict, adapters: dict, lora_scale: float, dtype=None) -> dict:
  """The params with each adapted matrix replaced by `w + lora_scale * a @ b` (summed in fp32, then
  cast to `dtype`, default each matrix's own). Jittable; unadapted leaves are passed through (cast)."""
  cast = (lambda x: x) if dtype is None else (lambda x: x.astype(dtype))
  out = jax.tree.map(cast, params)
  for i, layer in adapters["layers"].items():
    for module, weights in layer.items():
      for name, ab in weights.items():
        w = params["layers"][i][module][name]
        lead = ab["a"].ndim + ab["b"].ndim - 2 - w.ndim  # 1 for experts' adapters
        merged = w.astype(jnp.float32) + lora_scale * delta(ab["a"], ab["b"], lead)
        out["layers"][i][module][name] = merged.astype(dtype or w.dtype)
  return out


# --------------------------------------------------------------------------------------------------
# PEFT's adapter directory


def _peft_key(i: int, hf_name: str, part: str) -> str:
  return f"base_model.model.model.layers.{i}.{hf_name}.lora_{part}.weight"


def _peft_modules(i: int, hf_name: str, shape: tuple, lead: int) -> list[tuple[str, str]]:
  """(lora_A key, lora_B key) of each HF Linear one adapter covers: one, or one per expert."""
  names = [hf_name.format(x=x) for x in range(shape[0])] if lead else [hf_name]
  return [(_peft_key(i, n, "A"), _peft_key(i, n, "B")) for n in names]


def peft_adapter_config(lora, base_model_name_or_path: str | None) -> dict:
  """PEFT's `adapter_config.json` for `lora` (a `config.LoraConfig`)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
          "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "use_rslora": False,
          "target_modules": sorted({TARGETS[t][2].split(".")[-1] for t in lora.targets}), "bias": "none",
          "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def save_peft_adapter(adapters: dict, config: ModelConfig, lora, path: str | os.PathLike, *,
                      base_model_name_or_path: str | None = None) -> Path:
  """Write `adapters` (host or device arrays) as a PEFT LoRA directory that
  `peft.PeftModel.from_pretrained(base, path)` loads onto the HF model of `config`."""
  from safetensors.numpy import save_file

  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for i, module, name, hf_name, n_in, shape, lead in _adapted(config, lora):
    ab = adapters["layers"][i][module][name]
    a, b = np.asarray(jax.device_get(ab["a"]), np.float32), np.asarray(jax.device_get(ab["b"]), np.float32)
    a, b = (a, b) if lead else (a[None], b[None])  # [modules, *in, r], [modules, r, *out]
    for x, (key_a, key_b) in enumerate(_peft_modules(i, hf_name, shape, lead)):
      tensors[key_a] = np.ascontiguousarray(a[x].reshape(-1, lora.rank).T)  # [r, in]
      tensors[key_b] = np.ascontiguousarray(b[x].reshape(lora.rank, -1).T)  # [out, r]
  save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
  (path / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(lora, base_model_name_or_path), indent=2))
  return path


def load_peft_adapter(path: str | os.PathLike, config: ModelConfig, lora) -> dict:
  """The adapters (numpy fp32) of a PEFT LoRA directory, checked against `lora`: its `r`,
  `lora_alpha` and `target_modules` must be this run's `rank`, `alpha` and `targets`."""
  from safetensors.numpy import load_file

  path = Path(path)
  cfg_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
  for f in (cfg_file, weights_file):
    if not f.exists():
      raise FileNotFoundError(f"{f} is missing: {path} is not a PEFT LoRA adapter directory "
                              f"(expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
  found = json.loads(cfg_file.read_text())
  want = peft_adapter_config(lora, None)
  targets = found.get("target_modules")
  targets = sorted(targets) if isinstance(targets, list) else targets
  diff = [f"{k}: adapter {v!r}, this run {want[k]!r}" for k, v in
          (("peft_type", found.get("peft_type")), ("r", found.get("r")), ("lora_alpha", found.get("lora_alpha")),
           ("target_modules", targets)) if v != want[k]]
  if found.get("use_rslora"):
    diff.append("use_rslora: adapter True, this run False (scale alpha / rank)")
  if diff:
    raise ValueError(f"the adapter {path} does not match LoraConfig ({'; '.join(diff)}); set LoraConfig's "
                     "rank, alpha and targets to the adapter's")
  tensors = load_file(str(weights_file))
  out: dict = {"layers": {}}
  for i, module, name, hf_name, n_in, shape, lead in _adapted(config, lora):
    a_shape, b_shape = _ab_shapes(shape[lead:], n_in, 0, lora.rank)  # one module's
    a_all, b_all = [], []
    for keys in _peft_modules(i, hf_name, shape, lead):
      missing = [k for k in keys if k not in tensors]
      if missing:
        raise ValueError(f"{weights_file} has no tensor {missing[0]} (the model of this run has "
                         f"{config.num_layers} layers; is it the adapter's base?)")
      a, b = tensors[keys[0]].astype(np.float32), tensors[keys[1]].astype(np.float32)
      if a.shape != (lora.rank, math.prod(a_shape[:-1])) or b.shape != (math.prod(b_shape[1:]), lora.rank):
        raise ValueError(f"{weights_file}: {keys[0]} {a.shape} / {keys[1]} {b.shape} do not fit this model's "
                         f"projection {tuple(shape)} at rank {lora.rank}")
      a_all.append(a.T.reshape(a_shape))
      b_all.append(b.T.reshape(b_shape))
    a, b = (np.stack(a_all), np.stack(b_all)) if lead else (a_all[0], b_all[0])
    out["layers"].setdefault(i, {}).setdefault(module, {})[name] = {"a": a, "b": b}
  return out


