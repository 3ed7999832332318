"""Hugging Face checkpoints in and out: `config.json` + `*.safetensors` <-> our `Llama`.

Families (`llamarl_jax.model.config.FAMILIES`, chosen by config.json's `model_type`): Llama 3 / 3.1 /
3.2 (`LlamaForCausalLM`), Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), Qwen3 dense (`Qwen3ForCausalLM`),
Qwen3-MoE (`Qwen3MoeForCausalLM`: per sparse layer a router `mlp.gate` and one tensor per expert and
projection, `mlp.experts.{e}.{gate,up,down}_proj`, stacked into `[experts, ...]` arrays here). Each
family's `*ForSequenceClassification` too (`LlamaForSequenceClassification`, ...: the decoder with a
`score` head `[num_labels, hidden]`, no bias, instead of `lm_head`; `ModelConfig.num_labels`), the
format of reward models. Anything else (other MoE families, sliding-window attention, other RoPE
scalings) is refused with the field named.

Loading reads one tensor at a time (lazily, via `safe_open`) and places it straight onto its
sharding, so a large model never exists as a full replicated host copy. Saving writes a directory
that `transformers.AutoModelForCausalLM.from_pretrained` loads, atomically (temp dir + rename).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from llamarl_jax import parallel
from llamarl_jax.model.config import COMPUTE_FIELDS, FAMILIES, HF_LAYOUT, ROPE_TYPES, ModelConfig
from llamarl_jax.model.llama import Llama, abstract_model, split_params


class CheckpointError(ValueError):
  """A checkpoint directory is missing, malformed or describes a model we do not support."""


_SUPPORTED_ACTS = {"silu"}
_SUPPORTED_NAMES = ", ".join(f"{t!r} ({f.architecture})" for t, f in FAMILIES.items())
_YARN_KEYS = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")


def _rope_from_hf(hf: dict, source: str) -> tuple[float, dict | None]:
  """(rope_theta, rope_scaling or None) from either config layout, refusing types we do not compute.

  transformers < 5 writes `rope_scaling` + `rope_theta`; >= 5 writes `rope_parameters` holding both.
  """
  rope_params = hf.get("rope_parameters") or {}
  rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type") else None)
  rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
  if rope_type in (None, "default"):
    return rope_theta, None
  if rope_type not in ROPE_TYPES:
    raise CheckpointError(f"{source}: field rope_scaling.rope_type={rope_type!r} is not supported "
                          f"(supported: {', '.join(repr(t) for t in ROPE_TYPES)}); remove rope_scaling to run "
                          "with plain RoPE within the original context length")
  # like transformers, the pre-training length defaults to max_position_embeddings
  scaling = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **scaling}
  keys = ("factor", "original_max_position_embeddings") + (
      ("low_freq_factor", "high_freq_factor") if rope_type == "llama3" else ())
  missing = [k for k in keys if scaling.get(k) is None]
  if missing:
    raise CheckpointError(f"{source}: rope_scaling ({rope_type}) is missing {missing}")
  optional = _YARN_KEYS if rope_type == "yarn" else ()
  return rope_theta, {"rope_type": rope_type, **{k: scaling[k] for k in keys},
                      **{k: scaling[k] for k in optional if scaling.get(k) is not None}}


def _check_full_attention(hf: dict, source: str) -> None:
  """Refuse sliding-window attention: every layer here attends to the whole causal prefix."""
  sliding = [i for i, t in enumerate(hf.get("layer_types") or []) if t != "full_attention"]
  if hf.get("use_sliding_window") or sliding:
    where = f"layers {sliding}" if sliding else f"layers >= max_window_layers={hf.get('max_window_layers')}"
    raise CheckpointError(
        f"{source}: sliding-window attention (use_sliding_window={hf.get('use_sliding_window')}, "
        f"sliding_window={hf.get('sliding_window')}, {where}) is not supported: this model computes full "
        "causal attention, which differs from the checkpoint's on sequences longer than the window. If every "
        "prompt + response is shorter than sliding_window the two agree: then set use_sliding_window=false "
        "(and drop sliding layer_types) in config.json")


def config_from_hf(hf: dict, *, source: str = "config.json", dtype=jnp.float32,
                   compute_dtype=None) -> ModelConfig:
  """Translate an HF `config.json` dict, refusing what the model cannot represent (names the field).

  The family comes from `model_type` (one of `FAMILIES`); `architectures`, when given, must name its
  causal-LM class or its sequence-classification class (a score head of `num_labels` outputs, from
  `id2label` as transformers counts them; 2 when absent, transformers' default).
  """
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise CheckpointError(f"{source}: model_type {model_type!r} is not supported; supported: {_SUPPORTED_NAMES} "
                          "(no other MoE families, no sliding window)")
  family = FAMILIES[model_type]
  archs = hf.get("architectures") or [family.architecture]
  classifier = family.architecture.replace("ForCausalLM", "ForSequenceClassification")
  if family.architecture not in archs and classifier not in archs:
    raise CheckpointError(f"{source}: architectures {archs} not supported for model_type {model_type!r} "
                          f"(need {family.architecture} or {classifier})")
  num_labels = 0
  if family.architecture not in archs:
    num_labels = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", 2)
  # Llama's attention_bias adds a bias to o_proj too, and Qwen3's to q, k, v and o: we have neither.
  # (Qwen2's q/k/v bias is part of the architecture; its config has no such field.)
  flags = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",),
           "qwen3_moe": ("attention_bias",)}.get(model_type, ())
  for field in flags:
    if hf.get(field, False):
      raise CheckpointError(f"{source}: field {field}={hf[field]!r} is not supported for model_type "
                            f"{model_type!r} (need false)")
  if hf.get("hidden_act", "silu") not in _SUPPORTED_ACTS:
    raise CheckpointError(f"{source}: field hidden_act={hf['hidden_act']!r} is not supported (need 'silu')")
  _check_full_attention(hf, source)
  rope_theta, rope_scaling = _rope_from_hf(hf, source)
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
  missing = [k for k in required if k not in hf]
  if missing:
    raise CheckpointError(f"{source}: missing required field(s) {missing}")
  param_dtype = jnp.dtype(dtype).name
  moe = {}
  if model_type == "qwen3_moe":
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    missing = [k for k, v in (("num_experts", num_experts), ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                              ("moe_intermediate_size", hf.get("moe_intermediate_size"))) if v is None]
    if missing:
      raise CheckpointError(f"{source}: model_type 'qwen3_moe' is missing field(s) {missing}")
    moe = dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
               moe_intermediate_size=hf["moe_intermediate_size"], norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               decoder_sparse_step=hf.get("decoder_sparse_step", 1), mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
               router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
  return ModelConfig(
      **moe,
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=hf["num_attention_heads"],
      num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      rope_theta=rope_theta,
      rope_scaling=rope_scaling,
      max_position_embeddings=hf.get("max_position_embeddings", 8192),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      model_type=model_type,
      num_labels=num_labels,
      param_dtype=param_dtype,
      dtype=jnp.dtype(compute_dtype or param_dtype).name,
  )


def config_to_hf(config: ModelConfig, *, torch_dtype: str = "float32", bos_token_id=None,
                 eos_token_id=None, pad_token_id=None) -> dict:
  """The family's own config.json, so `transformers` loads it back as the same class."""
  hf = {
      "architectures": [config.architecture],
      "model_type": config.model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": config.rope_scaling_dict,
      "rope_parameters": {"rope_type": "default", **(config.rope_scaling_dict or {}),
                          "rope_theta": config.rope_theta},
      "max_position_embeddings": config.max_position_embeddings,
      "tie_word_embeddings": config.tie_word_embeddings,
      "torch_dtype": torch_dtype,
      "bos_token_id": bos_token_id,
      "eos_token_id": eos_token_id,
      "pad_token_id": pad_token_id,
  }
  if config.num_labels:
    hf.update(id2label={str(i): f"LABEL_{i}" for i in range(config.num_labels)},
              label2id={f"LABEL_{i}": i for i in range(config.num_labels)})
  if config.model_type == "llama":
    hf.update(attention_bias=False, mlp_bias=False)
  else:  # qwen2 / qwen3: full attention in every layer
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers,
              layer_types=["full_attention"] * config.num_layers)
    if config.model_type in ("qwen3", "qwen3_moe"):
      hf.update(attention_bias=False)
    if config.model_type == "qwen3_moe":
      hf.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers),
                router_aux_loss_coef=config.router_aux_loss_coef, output_router_logits=False)
  return hf


# Our parameter path -> (HF tensor name, to_ours(hf_array, config), to_hf(our_array, config)).
def _tensor_map(config: ModelConfig) -> dict[tuple, tuple[str, Callable, Callable]]:
  d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  t = lambda x: np.ascontiguousarray(x.T)
  proj_in = lambda heads: (lambda w: t(w).reshape(d, heads, hd), lambda w: t(w.reshape(d, heads * hd)))
  m = {
      ("embed",): ("model.embed_tokens.weight", lambda w: w, lambda w: w),
      ("final_norm", "scale"): ("model.norm.weight", lambda w: w, lambda w: w),
  }
  if config.num_labels:
    m[("score",)] = ("score.weight", t, t)
  elif not config.tie_word_embeddings:
    m[("lm_head",)] = ("lm_head.weight", t, t)
  for i in range(config.num_layers):
    p = f"model.layers.{i}."
    m[("layers", i, "attn", "wq")] = (p + "self_attn.q_proj.weight", *proj_in(h))
    m[("layers", i, "attn", "wk")] = (p + "self_attn.k_proj.weight", *proj_in(kv))
    m[("layers", i, "attn", "wv")] = (p + "self_attn.v_proj.weight", *proj_in(kv))
    m[("layers", i, "attn", "wo")] = (p + "self_attn.o_proj.weight",
                                      lambda w: t(w).reshape(h, hd, d), lambda w: t(w.reshape(h * hd, d)))
    if config.qkv_bias:  # [heads * head_dim] <-> [heads, head_dim]
      for ours, name, heads in (("bq", "q_proj", h), ("bk", "k_proj", kv), ("bv", "v_proj", kv)):
        m[("layers", i, "attn", ours)] = (p + f"self_attn.{name}.bias", lambda w, n=heads: w.reshape(n, hd),
                                          lambda w: w.reshape(-1))
    if config.qk_norm:
      for ours in ("q_norm", "k_norm"):
        m[("layers", i, "attn", ours, "scale")] = (p + f"self_attn.{ours}.weight", lambda w: w, lambda w: w)
    if config.is_moe_layer(i):  # router [experts, embed]; expert e's projections one tensor each
      m[("layers", i, "mlp", "router")] = (p + "mlp.gate.weight", t, t)
      for ours, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
        names = tuple(p + f"mlp.experts.{e}.{name}.weight" for e in range(config.num_experts))
        m[("layers", i, "mlp", ours)] = (names, lambda ws: np.stack([t(w) for w in ws]), lambda w: [t(x) for x in w])
    else:
      m[("layers", i, "mlp", "w_gate")] = (p + "mlp.gate_proj.weight", t, t)
      m[("layers", i, "mlp", "w_up")] = (p + "mlp.up_proj.weight", t, t)
      m[("layers", i, "mlp", "w_down")] = (p + "mlp.down_proj.weight", t, t)
    m[("layers", i, "attn_norm", "scale")] = (p + "input_layernorm.weight", lambda w: w, lambda w: w)
    m[("layers", i, "mlp_norm", "scale")] = (p + "post_attention_layernorm.weight", lambda w: w, lambda w: w)
  return m


def _names(name: str | tuple[str, ...]) -> tuple[str, ...]:
  """The HF tensor names of one of our parameters (several for stacked experts)."""
  return name if isinstance(name, tuple) else (name,)


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree[k]
  tree[path[-1]] = value


def _safetensors_index(path: Path) -> dict[str, Path]:
  """HF tensor name -> file holding it (single-file and sharded layouts)."""
  index_file = path / "model.safetensors.index.json"
  if index_file.exists():
    try:
      weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index_file}: not a valid safetensors index ({e})") from e
    files = {name: path / fname for name, fname in weight_map.items()}
    for f in set(files.values()):
      if not f.exists():
        raise CheckpointError(f"{index_file} lists shard {f.name}, which is missing from {path}")
    return files
  single = path / "model.safetensors"
  if not single.exists():
    found = sorted(p.name for p in path.iterdir())
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json (found {found})")
  with safe_open(single, framework="np") as f:
    return {name: single for name in f.keys()}


def load_hf_checkpoint(path: str | os.PathLike, *, dtype=jnp.float32, compute_dtype=None,
                       mesh=None, rules=parallel.RULES) -> tuple[ModelConfig, Llama]:
  """Load an HF Llama / Qwen2 / Qwen3 directory into our `Llama` (params in `dtype`, optionally sharded on `mesh`)."""
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"checkpoint directory {path} does not exist")
  config_file = path / "config.json"
  if not config_file.exists():
    raise CheckpointError(f"{config_file} is missing: not a Hugging Face checkpoint directory")
  try:
    hf_config = json.loads(config_file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{config_file}: invalid JSON ({e})") from e
  config = config_from_hf(hf_config, source=str(config_file), dtype=dtype, compute_dtype=compute_dtype)
  files = _safetensors_index(path)

  abstract = abstract_model(config)
  graphdef, shapes = split_params(abstract)
  axes = parallel.logical_axes(abstract)
  shardings = None if mesh is None else parallel.param_shardings(shapes, axes, mesh, rules)
  tmap = _tensor_map(config)
  expected = {n for name, *_ in tmap.values() for n in _names(name)}
  if config.tie_word_embeddings and not config.num_labels:
    expected.add("lm_head.weight")  # may or may not be stored; ignored when tied
  unexpected = sorted(n for n in files if n not in expected and "rotary_emb" not in n)
  if unexpected:
    raise CheckpointError(f"{path}: unexpected tensors {unexpected[:5]}{'...' if len(unexpected) > 5 else ''} "
                          "(does config.json match the weights?)")
  missing = sorted(n for name, *_ in tmap.values() for n in _names(name) if n not in files)
  if missing:
    raise CheckpointError(f"{path}: missing tensors {missing[:5]}{'...' if len(missing) > 5 else ''}")

  params = jax.tree.map(lambda x: None, shapes)
  handles: dict[Path, Any] = {}
  try:
    for our_path, (name, to_ours, _) in tmap.items():
      raws = []
      for n in _names(name):
        if files[n] not in handles:
          handles[files[n]] = safe_open(files[n], framework="np")
        raws.append(handles[files[n]].get_tensor(n))
      raw = raws if isinstance(name, tuple) else raws[0]
      want = _get(shapes, our_path)
      try:
        value = to_ours(raw)
      except ValueError:
        value = np.zeros(0)
      if value.shape != want.shape:
        first = _names(name)[0]
        raise CheckpointError(f"{files[first].name}: tensor {first} has shape {raws[0].shape}, which does not "
                              f"fit {want.shape} (our layout) implied by config.json")
      value = value.astype(want.dtype)
      sharding = None if shardings is None else _get(shardings, our_path)
      _set(params, our_path, jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value))
  finally:
    handles.clear()
  return config, nnx.merge(graphdef, params)


def save_hf_checkpoint(model: Llama, config: ModelConfig, path: str | os.PathLike, *,
                       dtype=None, tokenizer=None, pad_token_id: int | None = None,
                       max_shard_bytes: int = 5 * 2**30) -> Path:
  """Write `model` as an HF directory of its family (config.json + safetensors, sharded above max_shard_bytes).

  Its class is `config.architecture` (the causal LM, or the sequence classifier of a score head).
  config.json's special token ids come from `tokenizer`; `pad_token_id` overrides the pad id (a
  sequence classifier needs one to score batches: transformers reads each row at its last non-pad
  token). Written into a temp directory and renamed into place, so a crash never leaves half a checkpoint.
  """
  if model.layout != HF_LAYOUT:
    raise ValueError(f"the model holds the generator's serving layout ({model.layout}); save the trainer's "
                     "params (Hugging Face's projections), not the generator's fused copy")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  _, params = split_params(model)
  out_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
  tensors: dict[str, np.ndarray] = {}
  for our_path, (name, _, to_hf) in _tensor_map(config).items():
    value = to_hf(np.asarray(jax.device_get(_get(params, our_path))))
    for n, v in zip(_names(name), value if isinstance(name, tuple) else [value]):
      tensors[n] = np.ascontiguousarray(v.astype(out_dtype))
  hf_config = config_to_hf(config, torch_dtype=out_dtype.name)
  if tokenizer is not None:
    hf_config.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
  if pad_token_id is not None:
    hf_config["pad_token_id"] = pad_token_id
  tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp", dir=path.parent))
  try:
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    shards, current, size = [], {}, 0
    for name, arr in tensors.items():
      if current and size + arr.nbytes > max_shard_bytes:
        shards.append(current)
        current, size = {}, 0
      current[name] = arr
      size += arr.nbytes
    shards.append(current)
    if len(shards) == 1:
      save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
    else:
      weight_map = {}
      for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
      total = sum(a.nbytes for a in tensors.values())
      (tmp / "model.safetensors.index.json").write_text(
          json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if tokenizer is not None:
      tokenizer.save_pretrained(str(tmp))
    if path.exists():
      old = path.with_name(path.name + ".old")
      shutil.rmtree(old, ignore_errors=True)
      path.rename(old)
      tmp.rename(path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      tmp.rename(path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path


def load_tokenizer(path: str | os.PathLike):
  """`transformers.AutoTokenizer` from a local directory, with a clear error when absent."""
  from transformers import AutoTokenizer  # heavy import, only when needed

  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"tokenizer directory {path} does not exist")
  if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
    raise CheckpointError(f"{path}: no tokenizer.json / tokenizer_config.json / tokenizer.model")
  return AutoTokenizer.from_pretrained(str(path))


def check_tokenizer_matches(tokenizer, config: ModelConfig) -> None:
  """Raise if the tokenizer produces ids the model's embedding cannot hold."""
  n = len(tokenizer)
  if n > config.vocab_size:
    raise CheckpointError(f"tokenizer has {n} tokens but the model's vocab_size is {config.vocab_size}: "
                          "tokenizer/model mismatch")


def load_reference_params(path: str, config: ModelConfig) -> Any:
  """Params of the KL reference policy from an HF checkpoint directory (same architecture as the policy)."""
  ref_config, model = load_hf_checkpoint(path)
  fields = [f.name for f in dataclasses.fields(config) if f.name not in ("param_dtype", "dtype", *COMPUTE_FIELDS)]
  diff = [f"{f}: policy {getattr(config, f)}, reference {getattr(ref_config, f)}" for f in fields
          if getattr(config, f) != getattr(ref_config, f)]
  if diff:
    raise ValueError(f"the KL reference {path} does not have the policy's architecture ({'; '.join(diff)}); "
                     "give a checkpoint of the same model, or leave TrainConfig.reference_path unset to use "
                     "the initial policy")
  return split_params(model)[1]
