"""The generator's engine: batched sampling with a preallocated KV cache, on a (data, tp) mesh.

`Sampler.generate(params, prompts, sampling)` turns token-id prompts into a `RolloutBatch`:

  host:    repeat each prompt `n` times, left-pad to a bucket length P, pad the batch to a multiple
           of the mesh's data axis, and put it on the mesh (batch over `data`, params over `tp`).
  prefill: one jitted call runs the prompts through the model into a fresh KV cache of length
           P + R (R = max_new_tokens) and samples the first response token.
  decode:  one jitted call runs a `lax.while_loop` on device (the cache donated to it): each step
           feeds the last token, samples the next, and the loop exits as soon as every row has
           stopped or R tokens exist. No host round trip per token.

Shapes depend only on (P bucket, padded batch, R) and the static sampling switches (greedy, top_k,
top_p < 1), so new prompts of similar length reuse the compiled functions; temperature, top_p,
seed and stop ids are traced values.

Behaviour log-probs are those of the distribution actually sampled from: log-softmax of
logits / temperature restricted to the top-k / top-p set and renormalised. For greedy decoding
(temperature 0) the one-hot distribution would give log 1 = 0, which says nothing, so we report the
log-softmax of the untempered logits at the argmax instead (the model's own log-prob of the token).

Random numbers: the key of row r at step t is fold_in(fold_in(seed_key, t), r), so a row's samples
do not depend on how the batch is sharded. Callers that generate many batches must vary `seed` (or
pass `rng`), otherwise row r of every batch sees the same noise.

Continuous batching (refilling a finished row while others decode, weights swapped mid-generation)
is `engine.SlotEngine`: it shares the model, `sample_logits` and the per-token keys with this
sampler (and samples the same tokens for the same seed); this static sampler stays for evaluation,
tests and `scripts/generate.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from llamarl_jax import parallel
from llamarl_jax.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch
from llamarl_jax.model import serving
from llamarl_jax.model import exact as exact_lib
from llamarl_jax.model import fp8 as fp8_lib
from llamarl_jax.model.config import COMPUTE_FIELDS, HF_LAYOUT, QUANTIZATIONS, ModelConfig, WeightLayout
from llamarl_jax.model.llama import KVCache, Llama, abstract_model, merge_params, split_params

Array = jax.Array

DEFAULT_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)


def prompt_bucket(length: int, buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS) -> int:
  """The padded prompt length for a longest prompt of `length` tokens: the smallest of the sorted
  `buckets` that holds it, past the largest a multiple of the largest."""
  for b in buckets:
    if length <= b:
      return b
  return -(-length // buckets[-1]) * buckets[-1]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample. temperature 0 = greedy; top_k 0 = off; top_p 1 = off.

  n: samples per prompt (contiguous rows sharing a group id). stop_token_ids: a sampled stop token
  ends its row (it is part of the response). seed: the default PRNG seed of `Sampler.generate`.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 64
  n: int = 1
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0

  def __post_init__(self):
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
    if not self.temperature >= 0:
      raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.n < 1:
      raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


# ----------------------------------------------------------------------------- sampling step


# Top-p without top-k first ranks this many candidates (see `sample_logits`): enough for the nucleus
# of nearly every step of a trained LLM at top_p <= 0.95 (not of a random model: near-uniform logits
# take the fallback). On CPU `lax.top_k(x, 1024)` of [64, 128256] logits costs ~1/60 of the full
# sort. XLA:GPU has a dedicated top-k kernel only for k <= 16 and sorts for a larger k, so there the
# saving is the Gumbel draw and the cumsum over V rather than the sort: measure before relying on it.
TOP_P_CANDIDATES = 1024


def sample_logits(key: Array, logits: Array, *, temperature: float | Array = 1.0, top_k: int = 0,
                  top_p: float | Array = 1.0, greedy: bool = False, use_top_p: bool | None = None,
                  top_p_candidates: int = TOP_P_CANDIDATES, exact: bool = False) -> tuple[Array, Array]:
  """Sample one token per row from `logits [B, V]`; returns (tokens int32 [B], logprobs f32 [B]).

  The distribution is softmax(logits / temperature), restricted to the `top_k` most likely tokens
  (0 = all), then to the smallest prefix of those (by probability) whose mass reaches `top_p`, and
  renormalised; `logprobs` is the log-probability of each sampled token under exactly that
  distribution. `greedy`: argmax, with logprobs = log_softmax(logits) at the argmax (untempered).

  No path asks for the whole vocabulary sorted (`lax.top_k(x, V)`) unless it has to:
    no filter: one Gumbel-max draw over the vocabulary; log mu = x[token] - logsumexp(x), without a
               [B, V] log-softmax.
    top-k:     `lax.top_k(x, k)`, top-p (if on) within the renormalised k, a draw over the k.
    top-p:     `lax.top_k(x, top_p_candidates)` and the candidates' probabilities under the full
               softmax. The nucleus is a prefix of the descending order that ends at the first
               prefix of mass >= top_p, so when every row's candidates hold mass >= top_p it lies
               inside them and the draw is over them; otherwise (`lax.cond`: only then) the whole
               vocabulary is sorted, as before. Exact in both branches, not an approximation.
               (Under `jax.vmap` a cond becomes a select that runs both: call it on the batch.)
  Draws are `jax.random.categorical` (Gumbel-max) over the candidates in descending order, as
  before. With partitionable threefry (JAX's default) the noise of candidate j depends only on
  (row key, j), so the capped top-p draw picks the same token as the full-sort draw for the same
  key: tokens for a seed are those of the full sort on every path (float rounding aside: a token
  whose preceding mass equals top_p to ~1e-7 may fall on either side).

  `greedy`, `top_k`, `use_top_p` and `top_p_candidates` are static; `temperature` and `top_p` may be
  traced. `use_top_p` defaults to `top_p < 1` (pass it when `top_p` is traced). `key`: one PRNG key,
  and row r draws with fold_in(key, r), so results do not depend on how the batch is split across
  devices; or a `[B]` array of keys, one per row (the slot engine, whose rows are unrelated sequences).
  exact: the log-probs are `model.exact.token_logprob`'s (the trainer's arithmetic, whatever the batch:
  `ModelConfig.exact`); unfiltered sampling only (`top_k`, `top_p` off), as `RolloutConfig` checks.
  """
  logits = logits.astype(jnp.float32)
  B, V = logits.shape
  if greedy:
    tokens = jnp.argmax(logits, axis=-1)
    return tokens.astype(jnp.int32), (exact_lib.token_logprob(logits, tokens) if exact else _logprob_of(logits, tokens))
  if use_top_p is None:
    use_top_p = bool(top_p < 1)
  top_k = 0 if top_k >= V else top_k
  if exact and (top_k or use_top_p):
    raise ValueError(f"exact log-probs are those of unfiltered sampling; got top_k={top_k}, top_p={top_p} "
                     "(set RolloutConfig.top_k = 0 and top_p = 1.0)")
  x = logits / temperature
  if key.ndim == 1:
    row_keys = key
  else:
    row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(B, dtype=jnp.uint32))
  if not top_k and not use_top_p:  # no filtering: no sort, sample over the full vocabulary
    tokens = jax.vmap(jax.random.categorical)(row_keys, x)
    if exact:
      return tokens.astype(jnp.int32), exact_lib.token_logprob(logits, tokens, temperature)
    return tokens.astype(jnp.int32), _logprob_of(x, tokens)
  if top_k:  # top-p, if on, within the renormalised top k
    vals, idx = jax.lax.top_k(x, top_k)
    if use_top_p:
      vals, _ = _nucleus(vals, jax.nn.softmax(vals, axis=-1), top_p)
    return _draw_ranked(row_keys, vals, idx)

  def full_sort():
    vals, idx = jax.lax.top_k(x, V)
    return _draw_ranked(row_keys, _nucleus(vals, jax.nn.softmax(vals, axis=-1), top_p)[0], idx)

  cap = min(int(top_p_candidates), V)
  if cap == V:
    return full_sort()
  vals, idx = jax.lax.top_k(x, cap)
  # The max from x, not vals[:, :1]: a second slice of the candidates keeps XLA (CPU) from matching
  # top_k to its TopK kernel, and it sorts the whole row instead.
  top = jnp.max(x, axis=-1, keepdims=True)
  probs = jnp.exp(vals - top) / jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True)  # under the full softmax
  vals, mass = _nucleus(vals, probs, top_p)
  held = jnp.all(mass >= top_p)  # every row's nucleus ends among the candidates
  return jax.lax.cond(held, lambda: _draw_ranked(row_keys, vals, idx), full_sort)


def _pick(x: Array, idx: Array) -> Array:
  """x[b, idx[b]] for `x [B, N]`, `idx [B]`."""
  return jnp.take_along_axis(x, idx[:, None].astype(jnp.int32), axis=-1)[:, 0]


def _logprob_of(x: Array, tokens: Array) -> Array:
  """log_softmax(x)[b, tokens[b]] for `x [B, N]`, from one max and one sum of exp (no [B, N] output)."""
  m = jnp.max(x, axis=-1, keepdims=True)
  return _pick(x - m, tokens) - jnp.log(jnp.sum(jnp.exp(x - m), axis=-1))


def _nucleus(vals: Array, probs: Array, top_p: float | Array) -> tuple[Array, Array]:
  """Descending candidates `vals [B, N]` masked (-inf) outside the top-p nucleus, and their mass [B].

  probs `[B, N]`: their probabilities (under the full softmax, or the top-k's renormalised one). A
  candidate stays while the mass of the strictly better ones is < top_p, so the best always stays;
  a candidate past the N would have the mass of all N before it, so mass >= top_p means the
  nucleus ends among them.
  """
  cum = jnp.cumsum(probs, axis=-1)
  return jnp.where(cum - probs < top_p, vals, -jnp.inf), cum[:, -1]


def _draw_ranked(row_keys: Array, vals: Array, idx: Array) -> tuple[Array, Array]:
  """Gumbel-max draw per row among candidates `vals [B, N]` (-inf: excluded) with vocabulary ids `idx [B, N]`.

  Returns (tokens int32 [B], log-probs [B] under softmax(vals): the kept set, renormalised)."""
  choice = jax.vmap(jax.random.categorical)(row_keys, vals)
  return _pick(idx, choice).astype(jnp.int32), _pick(jax.nn.log_softmax(vals), choice)


# ----------------------------------------------------------------------------- the sampler


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
  """Token-id prompts as int64 arrays; raises on an empty list, an empty prompt or ids outside the vocab."""
  if len(prompts) == 0:
    raise ValueError("generate() needs at least one prompt")
  prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
  lengths = [len(p) for p in prompts]
  if min(lengths) == 0:
    raise ValueError(f"prompt {lengths.index(0)} is empty; every prompt needs at least one token (e.g. BOS)")
  for i, p in enumerate(prompts):
    if p.min() < 0 or p.max() >= vocab_size:
      raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): min {p.min()}, max {p.max()}")
  return prompts


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything that changes the compiled program besides array shapes."""

  max_new_tokens: int
  greedy: bool
  top_k: int
  use_top_p: bool


class Sampler:
  """Generates rollouts for one model architecture on one generator mesh.

  mesh: a `(data, fsdp, expert, tp)` mesh (see `parallel.make_mesh`); None = the first device. Params
    are sharded with `param_shardings(rules)` (tensor parallel over `tp`), the batch over data x fsdp;
    the forwards run a MoE model's expert layers over it (`moe.grouped_swiglu`: each device routes its
    own rows; an `expert` axis computes the experts in parallel, each device its own).
  pad_id: written in padded prompt slots and after a row's finish.
  prompt_buckets: prompt lengths are rounded up to the next bucket (past the largest: to a multiple
    of it), so prompts of similar length share one compiled program.
  batch_multiple: the batch (n_prompts * n) is padded up to a multiple of this (default: the mesh's
    data x fsdp size; always rounded to a multiple of it). A larger value means fewer recompiles
    for a varying number of prompts.
  layout: which projections the weights on this mesh hold fused (`WeightLayout`; default
    `serving.serving_layout`: Q/K/V and gate/up fused; its precision is `quantize`). `place_params`
    takes the trainer's (Hugging Face's) layout and fuses on this mesh; `graphdef` and
    `param_shardings` are the serving layout's (`self.layout`).
  quantize: the weights' precision, one of `model.config.QUANTIZATIONS`: None (the generator dtype),
    'fp8' (the projections in float8_e4m3fn with per-output-channel scales, computed as fp8 GEMMs,
    `model.fp8`) or 'fp8+lm_head' (the lm_head too, a scale per vocabulary row; tied embeddings: an
    fp8 copy for the logits, the lookup in the generator dtype). `place_params` quantises what
    arrives unquantised on this mesh, after the fusion's inputs are placed, and fuses what arrives
    quantised as it is.

  `num_traces` counts how often the prefill/decode functions were traced (= compiled).
  """

  def __init__(self, config: ModelConfig, mesh: Mesh | None = None, *, pad_id: int = 0,
               prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS, batch_multiple: int | None = None,
               rules: Mapping[str, str | None] = parallel.RULES, layout: WeightLayout | None = None,
               quantize: str | None = None):
    self.config = config
    self.mesh = mesh if mesh is not None else parallel.make_mesh(jax.devices()[:1])
    self.pad_id = int(pad_id)
    self.prompt_buckets = tuple(sorted(int(b) for b in prompt_buckets))
    if not self.prompt_buckets or self.prompt_buckets[0] < 1:
      raise ValueError(f"prompt_buckets must be positive lengths, got {prompt_buckets}")
    divisor = parallel.batch_divisor(self.mesh)
    self.batch_multiple = math.lcm(divisor, int(batch_multiple or divisor))
    self.rules = dict(rules)

    fused = serving.serving_layout(config, self.mesh, rules) if layout is None else layout
    self.layout = dataclasses.replace(fused, quantize=quantize)
    # the layouts params arrive in: the trainer's and checkpoints' (Hugging Face's projections), in this
    # sampler's precision or a lower one (`QUANTIZATIONS` is ordered); what is missing is quantised here
    self.hf_shardings = self._shardings(HF_LAYOUT)
    self.arrival_layouts = tuple(WeightLayout(quantize=q)
                                 for q in QUANTIZATIONS[:QUANTIZATIONS.index(self.layout.quantize) + 1])
    self._arrival_shardings = {a: self._shardings(a) for a in self.arrival_layouts[1:]}
    abstract = abstract_model(config, self.layout)
    self.graphdef, shapes = split_params(abstract)
    self.param_avals = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
    self.param_shardings = parallel.param_shardings(shapes, parallel.logical_axes(abstract), self.mesh, rules)
    self._fuse = jax.jit(serving.fuse, out_shardings=serving.fused_part(self.param_shardings))
    # the projections' program: the fp8 lm_head is `_quantize_head`'s
    layers_layout = dataclasses.replace(self.layout, quantize="fp8" if self.layout.fp8 else None)
    self._quantize = jax.jit(lambda layers: serving.serving_params({"layers": layers}, layers_layout)["layers"],
                             out_shardings=self.param_shardings["layers"])
    if self.layout.fp8_lm_head:
      self._quantize_head = jax.jit(fp8_lib.quantize_head, out_shardings=(
          self.param_shardings[fp8_lib.HEAD], self.param_shardings[fp8_lib.HEAD + fp8_lib.SCALE]))
    kv_spec = parallel.logical_to_spec((None, None, "kv_heads", "head_dim"),
                                       (1, 1, config.num_kv_heads, config.head_dim), self.mesh, rules)
    self.cache_sharding = NamedSharding(self.mesh, P(parallel.BATCH_AXES, *kv_spec[1:]))
    self._batch1 = parallel.batch_sharding(self.mesh, 1)
    self._batch2 = parallel.batch_sharding(self.mesh, 2)
    self._repl = parallel.replicated(self.mesh)
    self._fns: dict[_Static, tuple[Any, Any]] = {}
    self.num_traces = 0
    self.last_decode_steps: Array | None = None  # device scalar: decode iterations of the last call

  # -- public -----------------------------------------------------------------

  def generate(self, params_or_model: Llama | dict, prompts: Sequence[Sequence[int]],
               sampling: SamplingParams = SamplingParams(), *, policy_version: int = 0,
               rng: Array | None = None) -> RolloutBatch:
    """Sample `sampling.n` responses per prompt; rows [i*n, (i+1)*n) belong to prompt i.

    params_or_model: a `Llama` or the params dict of `split_params` (placed on this sampler's
      mesh if not already there). prompts: token ids, each non-empty. rng: a PRNG key overriding
      `sampling.seed`. Returns device arrays with R = max_new_tokens exactly and P = the bucket.
    """
    params = self.place_params(params_or_model)
    tokens, mask, n_rows = self._pad_prompts(prompts, sampling.n)
    static = _Static(sampling.max_new_tokens, sampling.greedy,
                     0 if sampling.top_k >= self.config.vocab_size else sampling.top_k,
                     sampling.top_p < 1)
    prefill, decode = self._compiled(static)

    if rng is None:
      rng = jax.random.key(sampling.seed)
    elif not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
      rng = jax.random.wrap_key_data(rng)
    put = jax.device_put
    tokens_d, mask_d = put(tokens, self._batch2), put(mask, self._batch2)
    stops = sampling.stop_token_ids  # padded with -1 (matches no token) to a multiple of 8: fewer shapes
    stop_ids = np.full(max(8, -(-len(stops) // 8) * 8), -1, np.int32)
    stop_ids[:len(stops)] = stops
    # The key travels as host bits: a mesh spread over processes takes host values, not local arrays.
    scalars = put((np.asarray(jax.random.key_data(rng)), np.float32(max(sampling.temperature, 1e-6)),
                   np.float32(sampling.top_p), stop_ids, np.int32(n_rows)), self._repl)
    key_bits, temperature, top_p, stop_ids, num_real = scalars
    rng = jax.random.wrap_key_data(key_bits, impl=jax.random.key_impl(rng))

    cache, first_token, first_logprob, *prompt_routing = prefill(params, tokens_d, mask_d, rng, temperature, top_p)
    out_tokens, logprobs, lengths, finish, steps, _, *response_routing = decode(
        params, cache, first_token, first_logprob, mask_d, num_real, rng, temperature, top_p, stop_ids)
    routing = jnp.concatenate(prompt_routing + response_routing, axis=1) if prompt_routing else None
    self.last_decode_steps = steps

    B = tokens.shape[0]
    group_ids = np.repeat(np.arange(len(prompts), dtype=np.int32), sampling.n)
    group_ids = np.concatenate([group_ids, np.full(B - n_rows, -1, np.int32)])
    response_mask = (jnp.arange(sampling.max_new_tokens)[None, :] < lengths[:, None]).astype(jnp.int32)
    batch = RolloutBatch(
        prompt_tokens=tokens_d, prompt_mask=mask_d, response_tokens=out_tokens,
        response_mask=response_mask, behaviour_logprobs=logprobs, lengths=lengths,
        finish_reason=finish, group_ids=put(group_ids, self._batch1),
        policy_version=put(np.full(B, policy_version, np.int32), self._batch1),
        token_versions=put(np.full((B, sampling.max_new_tokens), policy_version, np.int32), self._batch2),
        routing=routing)
    if n_rows < B:  # drop the rows that only padded the batch to the mesh
      batch = jax.tree.map(lambda x: x[:n_rows], batch)
    return batch

  def prompt_bucket(self, length: int) -> int:
    """The padded prompt length for a longest prompt of `length` tokens."""
    return prompt_bucket(length, self.prompt_buckets)

  # -- host side ----------------------------------------------------------------

  def place_params(self, params_or_model):
    """A `Llama` or a `split_params` dict -> the params dict in this sampler's layout and shardings.

    The trainer's (Hugging Face's) layout is placed on this mesh, then its Q/K/V and gate/up are
    fused here (`serving.fuse`, one jitted call; the other leaves are not copied); params already
    in the serving layout are only placed (no copy when already placed so)."""
    if isinstance(params_or_model, Llama):
      how = {f: getattr(self.config, f) for f in COMPUTE_FIELDS}  # how it is computed is the sampler's
      if params_or_model.config.replace(**how) != self.config:
        raise ValueError(f"model config {params_or_model.config} differs from the sampler's {self.config}; "
                         "build the Sampler with the model's config")
      _, params = split_params(params_or_model)
    else:
      params = params_or_model
    try:
      layout = serving.params_layout(params)
      if layout == self.layout:
        return jax.device_put(params, self.param_shardings)
      if layout not in self.arrival_layouts:
        raise ValueError(f"params in layout {layout}, this sampler's is {self.layout}")
      if self.layout.fp8 and not layout.fp8:  # quantised and fused on this mesh, in one program
        params = jax.device_put(params, self.hf_shardings)
        params = {**params, "layers": self._quantize(params["layers"])}
      else:
        params = jax.device_put(params, self._arrival_shardings.get(layout, self.hf_shardings))
        params = serving.with_fused(params, self._fuse(serving.fusion_inputs(params, self.layout)), self.layout)
      if self.layout.fp8_lm_head and not layout.fp8_lm_head:  # the fp8 lm_head made on this mesh
        values, scale = self._quantize_head({k: params[k] for k in ("embed", fp8_lib.HEAD) if k in params})
        params = {**{k: v for k, v in params.items() if k != fp8_lib.HEAD}, fp8_lib.HEAD: values,
                  fp8_lib.HEAD + fp8_lib.SCALE: scale}
      return params
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"params do not match the sampler's model structure ({type(e).__name__}: {e}); expected "
                       "the dict of `split_params(Llama(config))`") from e

  def _shardings(self, layout: WeightLayout) -> Any:
    abstract = abstract_model(self.config, layout)
    return parallel.param_shardings(split_params(abstract)[1], parallel.logical_axes(abstract), self.mesh, self.rules)

  def _pad_prompts(self, prompts, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Left-padded tokens and mask `[B_padded, P_bucket]`, and the number of real rows."""
    prompts = validate_prompts(prompts, self.config.vocab_size)
    lengths = [len(p) for p in prompts]
    n_rows = len(prompts) * n
    B = -(-n_rows // self.batch_multiple) * self.batch_multiple
    Pb = self.prompt_bucket(max(lengths))
    tokens = np.full((B, Pb), self.pad_id, np.int32)
    mask = np.zeros((B, Pb), np.int32)
    for i, p in enumerate(prompts):
      rows = slice(i * n, (i + 1) * n)
      tokens[rows, Pb - len(p):] = p
      mask[rows, Pb - len(p):] = 1
    mask[n_rows:, -1] = 1  # padding rows hold one pad token (never attended by real rows)
    return tokens, mask, n_rows

  # -- device side --------------------------------------------------------------

  def _compiled(self, static: _Static):
    """(prefill, decode) jitted for `static`; jit itself caches per shapes (P bucket, batch)."""
    if static not in self._fns:
      b1, b2, repl = self._batch1, self._batch2, self._repl
      cache_sh = KVCache(k=(self.cache_sharding,) * self.config.num_layers,
                         v=(self.cache_sharding,) * self.config.num_layers, index=repl)
      routed = (b2,) if self.config.num_experts else ()  # a MoE model's experts per position
      options = exact_lib.COMPILER_OPTIONS if self.config.exact else None  # GEMMs summing K in one pass
      prefill = jax.jit(
          exact_lib.traced_on(lambda *a: self._prefill(static, *a), self.mesh), compiler_options=options,
          in_shardings=(self.param_shardings, b2, b2, repl, repl, repl),
          out_shardings=(cache_sh, b1, b1, *routed))
      decode = jax.jit(
          exact_lib.traced_on(lambda *a: self._decode(static, *a), self.mesh), compiler_options=options,
          in_shardings=(self.param_shardings, cache_sh, b1, b1, b2, repl, repl, repl, repl, repl),
          out_shardings=(b2, b2, b1, b1, repl, cache_sh, *routed),
          donate_argnums=(1,))  # the loop updates the donated cache in place (returned, aliased)
      self._fns[static] = (prefill, decode)
    return self._fns[static]

  def _sample(self, static: _Static, key, logits, temperature, top_p):
    return sample_logits(key, logits, temperature=temperature, top_k=static.top_k, top_p=top_p,
                         greedy=static.greedy, use_top_p=static.use_top_p, exact=self.config.exact)

  def _cache_mask(self, prompt_mask, R: int):
    """`[B, P + R]` valid cache slots: the real prompt tokens and every generated slot."""
    return jnp.concatenate([prompt_mask, jnp.ones((prompt_mask.shape[0], R), prompt_mask.dtype)], axis=1)

  def _prefill(self, static: _Static, params, tokens, prompt_mask, key, temperature, top_p):
    """Prompts `[B, P]` -> (KV cache of length P + R, first tokens [B], their logprobs [B])."""
    self.num_traces += 1
    model = merge_params(self.graphdef, params)
    B, Pb = tokens.shape
    cache = KVCache.init(self.config, B, Pb + static.max_new_tokens)
    cache = jax.lax.with_sharding_constraint(
        cache, KVCache(k=(self.cache_sharding,) * self.config.num_layers,
                       v=(self.cache_sharding,) * self.config.num_layers, index=self._repl))
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)
    x, cache, routing = model.routed_hidden_states(tokens, positions, cache,
                                                   self._cache_mask(prompt_mask, static.max_new_tokens),
                                                   mesh=self.mesh)
    logits = model.logits(x[:, -1])  # only the last position's logits are needed
    token, logprob = self._sample(static, jax.random.fold_in(key, 0), logits, temperature, top_p)
    return (cache, token, logprob) + (() if routing is None else (routing,))

  def _decode(self, static: _Static, params, cache, first_token, first_logprob, prompt_mask, num_real,
              key, temperature, top_p, stop_ids):
    """The on-device decode loop.

    Returns tokens [B, R], logprobs [B, R], lengths [B], finish [B], the number of loop steps run,
    and the final cache (returned so the donated input buffer is reused in place, not copied); a MoE
    model also the experts of each response token as an input `[B, R, moe layers, k]` (-1 where
    none ran: the last token, rows already done).
    """
    self.num_traces += 1
    model = merge_params(self.graphdef, params)
    R = static.max_new_tokens
    B = first_token.shape[0]
    cache_mask = self._cache_mask(prompt_mask, R)
    prompt_len = jnp.sum(prompt_mask, axis=1).astype(jnp.int32)
    is_stop = lambda t: jnp.any(t[:, None] == stop_ids[None, :], axis=-1)

    real = jnp.arange(B) < num_real
    token = jnp.where(real, first_token, self.pad_id)
    stopped = real & is_stop(token)
    tokens = jnp.full((B, R), self.pad_id, jnp.int32).at[:, 0].set(token)
    logprobs = jnp.zeros((B, R), jnp.float32).at[:, 0].set(jnp.where(real, first_logprob, 0.0))
    lengths = real.astype(jnp.int32)
    done = stopped | ~real
    c = self.config
    n_moe = len(c.moe_layers)
    routing = jnp.full((B, R, n_moe, c.num_experts_per_tok), -1, jnp.int32) if n_moe else None

    def cond(state):
      t, _, _, done, *_ = state
      return (t < R) & ~jnp.all(done)

    def body(state):
      t, cache, prev, done, stopped, lengths, tokens, logprobs, routing = state
      positions = (prompt_len + t - 1)[:, None]  # the previous token sits at position len + t - 1
      x, cache, topk = model.routed_hidden_states(prev[:, None], positions, cache, cache_mask, mesh=self.mesh)
      if routing is not None:  # the experts of response token t - 1 as this step's input
        routing = jax.lax.dynamic_update_slice(routing, jnp.where(done[:, None, None, None], -1, topk),
                                               (0, t - 1, 0, 0))
      token, logprob = self._sample(static, jax.random.fold_in(key, t), model.logits(x[:, 0]),
                                    temperature, top_p)
      token = jnp.where(done, self.pad_id, token)
      logprob = jnp.where(done, 0.0, logprob)
      tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, t))
      logprobs = jax.lax.dynamic_update_slice(logprobs, logprob[:, None], (0, t))
      lengths = lengths + (~done).astype(jnp.int32)
      new_stop = ~done & is_stop(token)
      return t + 1, cache, token, done | new_stop, stopped | new_stop, lengths, tokens, logprobs, routing

    state = (jnp.int32(1), cache, token, done, stopped, lengths, tokens, logprobs, routing)
    steps, cache, _, _, stopped, lengths, tokens, logprobs, routing = jax.lax.while_loop(cond, body, state)
    finish = jnp.where(stopped, FINISH_STOP, FINISH_LENGTH).astype(jnp.int32)
    return (tokens, logprobs, lengths, finish, steps, cache) + (() if routing is None else (routing,))
