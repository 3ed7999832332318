"""The trainer's forward: right-padded rows from position 0 (or packed rows, `Segments`), layers
under `lax.scan` over stacked parameters (compile time flat in depth), fused causal attention with
per-row lengths, and the lm_head + log-prob + entropy in chunks of the sequence. The model,
checkpoints and the sampler keep the unrolled per-layer layout (decode updates each layer's cache in
place); `prepare_params` stacks the layers for the trainer, cast to the compute dtype in the same
pass (once per step). Each layer runs `model.llama.Block`: the same math as `Llama.hidden_states`.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from llamarl_jax import gpu_paths
from llamarl_jax.model import exact as exact_lib
from llamarl_jax.model import moe as moe_lib
from llamarl_jax.model.attention import Segments
from llamarl_jax.model.config import ModelConfig, rope_frequencies
from llamarl_jax.model.layers import LoraLayer, rms_norm
from llamarl_jax.model.llama import Block, Routing

Array = jax.Array


ATTENTION_IMPLEMENTATIONS = ("auto", "cudnn", "xla")
REMAT_POLICIES = ("none", "matmuls", "full")
# Positions per chunk of the trainer's lm_head + log-prob (`chunked_token_logprobs`): a [rows, 256,
# vocab] fp32 block at a time (8 rows x 256 x 128256 = 0.98 x 2^28 elements); a response of at most
# 256 tokens is one chunk, the unchunked computation.
DEFAULT_LOGPROB_CHUNK = 256


def resolve_attention(implementation: str, platform: str, dtype, packed: bool = False) -> str:
  """The attention kernel the trainer runs: 'auto' is 'cudnn' on a CUDA GPU in bf16/fp16 (the only
  dtypes cuDNN's fused kernel takes) where `gpu_paths` records cuDNN's form for the layout as passed
  on a GPU (packed: its segment-offset form, `segment_attention`), 'xla' elsewhere. 'cudnn' where it
  cannot run is an error (never a silent fallback); chosen by name it runs whether or not it has
  passed (opt-in). `platform`: a device platform ('cpu', 'gpu', 'cuda', 'tpu')."""
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attention implementation must be one of {ATTENTION_IMPLEMENTATIONS}, got {implementation!r}")
  gpu = platform in ("gpu", "cuda")
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if implementation == "auto":
    setting = "packed_attention" if packed else "trainer_attention"
    return "cudnn" if gpu and half and gpu_paths.passed(setting, "cudnn") else "xla"
  if implementation == "cudnn" and not (gpu and half):
    raise ValueError(f"attention='cudnn' (cuDNN fused attention) needs a CUDA GPU and a bfloat16/float16 "
                     f"compute dtype; got platform {platform!r}, dtype {jnp.dtype(dtype).name}. Use "
                     "attention='xla', or 'auto' (cuDNN where it can run, XLA elsewhere)")
  return implementation


def remat_policy(remat) -> str:
  """Normalise a remat setting: True -> 'full', False/None -> 'none', else one of REMAT_POLICIES.

  'none' keeps every activation; 'matmuls' saves the outputs of the (non-batched) matmuls and
  recomputes the rest (norms, RoPE, activations, attention); 'full' keeps only each layer's input."""
  if remat is None or remat is False:
    return "none"
  if remat is True:
    return "full"
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {REMAT_POLICIES} (or a bool: True = 'full'), got {remat!r}")
  return remat


def layer_runs(layers: dict) -> list[tuple[int, int]]:
  """Maximal runs `[(start, stop), ...]` of consecutive layers with the same parameter structure and
  shapes: one run for a dense model or a MoE model whose every layer is sparse, several when dense
  and sparse layers alternate (`decoder_sparse_step`, `mlp_only_layers`). `layers`: {i: layer tree}."""
  sig = lambda t: (jax.tree.structure(t), tuple(getattr(x, "shape", None) for x in jax.tree.leaves(t)))
  runs, start = [], 0
  for i in range(1, len(layers) + 1):
    if i == len(layers) or sig(layers[i]) != sig(layers[start]):
      runs.append((start, i))
      start = i
  return runs


def _stack(layers, runs, f):
  """{i: tree} -> one stacked tree (a single run) or a tuple of stacked trees, one per run."""
  stacked = tuple(jax.tree.map(lambda *xs: jnp.stack([f(x) for x in xs]), *[layers[i] for i in range(a, b)])
                  for a, b in runs)
  return stacked[0] if len(stacked) == 1 else stacked


def prepare_params(params: dict, dtype) -> dict:
  """The trainer's compute copy of `params` (the `split_params` dict): every leaf cast to `dtype` and
  the per-layer dicts stacked on a leading `[num_layers]` axis under "layers" (a tuple of such stacks,
  one per `layer_runs` run, when layers of different structure alternate). Differentiable: the
  gradient w.r.t. the result maps back with `unstack_layers` (and a cast)."""
  dtype = jnp.dtype(dtype)
  layers = params["layers"]
  out = {k: jax.tree.map(lambda x: x.astype(dtype), v) for k, v in params.items() if k != "layers"}
  out["layers"] = _stack(layers, layer_runs(layers), lambda x: x.astype(dtype))
  return out


def stacked_shardings(shardings: dict, mesh) -> dict:
  """`prepare_params`' layout of a `split_params`-shaped tree of shardings: each layer leaf's sharding
  with a replicated leading `[num_layers]` axis (per run of layers of one structure, `layer_runs`)."""
  from jax.sharding import NamedSharding, PartitionSpec

  stack = lambda layer: jax.tree.map(lambda sh: NamedSharding(mesh, PartitionSpec(None, *sh.spec)), layer)  # noqa: E731
  runs = layer_runs(shardings["layers"])
  stacked = tuple(stack(shardings["layers"][a]) for a, _ in runs)
  return {**{k: v for k, v in shardings.items() if k != "layers"}, "layers": stacked[0] if len(stacked) == 1 else stacked}


def stacked_runs(layers) -> tuple:
  """`prepare_params`' "layers" as a tuple of stacked runs (one element for a single run)."""
  return layers if isinstance(layers, tuple) else (layers,)


def unstack_layers(prepared: dict) -> dict:
  """Inverse layout of `prepare_params` (dtypes unchanged): "layers" back to {0: ..., 1: ...}."""
  out = {k: v for k, v in prepared.items() if k != "layers"}
  out["layers"], i = {}, 0
  for run in stacked_runs(prepared["layers"]):
    for j in range(jax.tree.leaves(run)[0].shape[0]):
      out["layers"][i] = jax.tree.map(lambda x: x[j], run)
      i += 1
  return out


@functools.lru_cache(maxsize=None)
def _block_graphdef(config: ModelConfig, moe: bool = False):
  return nnx.split(nnx.eval_shape(lambda: Block(config, nnx.Rngs(0), moe=moe)))[0]


@flax.struct.dataclass
class MoeTrace:
  """The routing of a MoE forward, over its MoE layers in order: topk `[B, T, moe layers, k]` int32
  (each token's experts), counts and prob_sum `[moe layers, experts]` (`moe.RouterStats`, over the
  real tokens), num_tokens: the real tokens counted (`moe.load_balancing_loss`'s denominator)."""

  topk: Array
  counts: Array
  prob_sum: Array
  num_tokens: Array

  def aux_loss(self) -> Array:
    """transformers' load-balancing loss (`moe.load_balancing_loss`) of this forward."""
    return moe_lib.load_balancing_loss(self.counts, self.prob_sum, self.num_tokens)


def _rematerialized(layer, remat):
  """`layer` under `jax.checkpoint` as `remat_policy(remat)` says ('full': only its input kept;
  'matmuls': the non-batched matmuls' outputs saved too), or `layer` itself ('none')."""
  policy = remat_policy(remat)
  if policy == "full":
    return jax.checkpoint(layer, prevent_cse=False)
  if policy == "matmuls":
    return jax.checkpoint(layer, prevent_cse=False, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  return layer


def scan_hidden_states(config: ModelConfig, prepared: dict, tokens: Array, lengths: Array, *,
                       attention: str = "xla", remat="none", scan_layers: bool = True,
                       lora: dict | None = None, lora_scale: float = 1.0, lora_dropout: float = 0.0,
                       dropout_key: Array | None = None, positions: Array | None = None,
                       replay: Array | None = None, with_routing: bool = False, mesh=None):
  """Final-norm hidden states `[B, T, E]` of right-padded rows, the layers under `lax.scan`.

  prepared: `prepare_params(params, config.dtype)`. tokens `[B, T]`: each row's sequence from
  position 0 (positions are 0..T-1), valid up to `lengths` `[B]`; states past a row's length are
  not meaningful. attention: 'xla' or 'cudnn' (see `resolve_attention`); remat: see `remat_policy`.
  Packed rows: `lengths` a `Segments` and `positions` `[B, T]` (restarting at 0 in each segment):
  attention stays within each segment (`segment_attention`).
  scan_layers=False unrolls the scan (the same program, one copy per layer): compile time grows with
  depth, but a small model on a CPU steps faster unrolled (the main job's trainer step: BENCHMARKS.md),
  XLA:CPU's loop over stacked layers costing more than the layers themselves.
  The same math as `Llama.hidden_states` (the same Block code runs on each layer's slice); layers of
  different structure (dense and MoE) run as consecutive scans, one per `layer_runs` run.
  lora: LoRA adapters in the layout `prepare_params` gives (`model.lora.init_adapters`' tree with
  "layers" stacked), added unmerged to the projections they adapt, times `lora_scale` (alpha / rank),
  their inputs dropped out with probability `lora_dropout` from `dropout_key` (a key per layer).
  MoE models: replay `[B, T, moe layers, k]` int32 replays those experts (`model.moe`); with
  `with_routing=True` the result is (hidden, `MoeTrace`) (the trace None for a dense model); mesh:
  the trainer's mesh, whose `expert` axis (if > 1) computes the experts in parallel (`moe.grouped_swiglu`).
  """
  dt = jnp.dtype(config.dtype)
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  inv_freq = rope_frequencies(config)
  if isinstance(lengths, Segments):
    token_mask = lengths.ids > 0
  else:
    lengths = lengths.astype(jnp.int32)
    token_mask = jnp.arange(T)[None, :] < lengths[:, None]
  runs = stacked_runs(prepared["layers"])
  if lora is not None and len(runs) > 1:
    raise ValueError("LoRA adapters need layers of one structure; this model alternates dense and MoE layers")

  def make_layer(graphdef):
    def layer(x, xs):
      layer_params, layer_lora, layer_key, layer_replay = xs
      adapters = None if layer_lora is None else LoraLayer(layer_lora, lora_scale, layer_key, lora_dropout)
      routing = Routing(token_mask=token_mask, replay=layer_replay, mesh=mesh)
      x, _, stats = nnx.merge(graphdef, layer_params)(x, positions, inv_freq, None, None, lengths, attention,
                                                      adapters, routing)
      return x, stats

    return _rematerialized(layer, remat)

  x = jnp.take(prepared["embed"], tokens, axis=0).astype(dt)
  keys = None
  if lora is not None and lora_dropout > 0 and dropout_key is not None:
    keys = jax.random.split(dropout_key, config.num_layers)
  traces, start, moe_index = [], 0, 0
  for run in runs:
    n = jax.tree.leaves(run)[0].shape[0]
    moe = config.is_moe_layer(start)
    run_replay = None
    if moe and replay is not None:  # [B, T, moe layers, k] -> this run's [n, B, T, k]
      run_replay = jnp.moveaxis(replay[:, :, moe_index:moe_index + n], 2, 0).astype(jnp.int32)
    run_keys = None if keys is None else keys[start:start + n]
    run_lora = None if lora is None else lora["layers"]
    x, stats = jax.lax.scan(make_layer(_block_graphdef(config, moe)), x, (run, run_lora, run_keys, run_replay),
                            unroll=not scan_layers)
    if stats is not None:
      traces.append(stats)
      moe_index += n
    start += n
  x = rms_norm(x, prepared["final_norm"]["scale"], config.rms_norm_eps, exact=config.exact)
  if not with_routing:
    return x
  if not traces:
    return x, None
  cat = lambda name: jnp.concatenate([getattr(t, name) for t in traces], axis=0)
  trace = MoeTrace(topk=jnp.moveaxis(cat("topk"), 0, 2), counts=cat("counts"), prob_sum=cat("prob_sum"),
                   num_tokens=jnp.sum(token_mask.astype(jnp.float32)))
  return x, trace


def lm_head_weight(config: ModelConfig, prepared: dict) -> Array:
  """The `[embed, vocab]` output projection (the embedding's transpose when tied)."""
  if config.num_labels:
    raise ValueError(f"a score-head model ({config.architecture}) has no lm_head; its head is "
                     "prepared['score'] [embed, num_labels]")
  return prepared["embed"].T if config.tie_word_embeddings else prepared["lm_head"]


def chunked_token_logprobs(hidden: Array, w: Array, tokens: Array, *, temperature: float = 1.0,
                           chunk: int | None = None, with_entropy: bool = True,
                           exact: bool = False) -> tuple[Array, Array | None]:
  """Log-prob and entropy of `tokens` under softmax(hidden @ w / temperature), without the full logits.

  hidden `[B, R, E]`, w `[E, V]`, tokens `[B, R]` int. Returns (logprobs, entropy), both fp32
  `[B, R]` (entropy None unless `with_entropy`). With `chunk` (positions per chunk) smaller than R, the R axis is cut into chunks that a
  `lax.scan` visits one at a time under `jax.checkpoint`: only one `[B, chunk, V]` logits array is
  alive, in the forward and in the backward pass (which recomputes it). `chunk=None` (or >= R):
  one piece, the plain computation. The logits are accumulated in fp32 whatever hidden's dtype; the
  backward pass sums w's gradient over chunks in w's dtype (bf16 when the trainer computes in bf16:
  a few chunks' partial sums, each from an fp32-accumulated matmul). exact: the log-probs are
  `model.exact`'s (`exact.dense` logits, `exact.token_logprob`: the sampler's behaviour log-probs'
  arithmetic, `ModelConfig.exact`); the entropy stays the plain form of those logits.
  """
  B, R, _ = hidden.shape

  def piece(h, t):  # h [B, c, E], t [B, c] -> logprobs, entropy [B, c]
    if exact:
      logits = exact_lib.dense(h, w, out_dtype=jnp.float32)
      logprobs = exact_lib.token_logprob(logits, t, temperature)
      if not with_entropy:
        return logprobs, None
      logits = logits / temperature
      return logprobs, jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    logits = jnp.einsum("bce,ev->bcv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    logits = logits / temperature
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not with_entropy:
      return picked - log_z, None
    entropy = log_z - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    return picked - log_z, entropy

  if chunk is None or chunk >= R:
    return piece(hidden, tokens)
  if chunk < 1:
    raise ValueError(f"chunk must be a positive number of positions (or None), got {chunk}")
  n = -(-R // chunk)
  pad = n * chunk - R
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
  t = jnp.pad(tokens, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
  step = jax.checkpoint(lambda carry, ht: (carry, piece(*ht)), prevent_cse=False)
  _, (logprobs, entropy) = jax.lax.scan(step, None, (h, t))
  unchunk = lambda x: None if x is None else x.swapaxes(0, 1).reshape(B, n * chunk)[:, :R]
  return unchunk(logprobs), unchunk(entropy)
