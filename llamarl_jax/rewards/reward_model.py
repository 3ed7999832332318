"""Reward models and critics: the decoder with a scalar head (HF `*ForSequenceClassification`).

`RewardModel.from_pretrained(path)` loads a Llama / Qwen2 / Qwen3 `*ForSequenceClassification`
directory with one label (`num_labels = 1`, the `score` head, no bias) through `model.hf`, sharded on
`mesh` by the policy's rules. Its forward is the trainer's (`scan_hidden_states`: right-padded rows
from position 0, per-row lengths, cuDNN attention on a GPU in bf16) with the head in place of the
lm_head:

  score_tokens(rows)   one score per row, read at the row's last non-pad token as transformers does
                       (the rightmost token whose id is not `pad_id`; the last token when there is no
                       pad id); rows of any lengths, right-padded here to a power-of-two width
  score(texts)         the same from text, through the model's own tokenizer and chat template
  values(tokens)       the head at every position `[B, T]`: a critic's V(s_t) after reading token t

Device programs: rows are sorted by length and scored in chunks of `batch_rows` at most, each chunk
at its own width (so short rows are not padded to the longest of the whole call); a chunk's row count
is rounded up to a power of two (and to the mesh's batch divisor) and its width to a power of two from
`min_width` (at most the context), so a stream of batches of one size compiles about one program per
width octave.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import compat, parallel
from llamarl_jax.model import hf
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.forward import (prepare_params, resolve_attention, scan_hidden_states, stacked_shardings,
                                       unstack_layers)
from llamarl_jax.model.llama import abstract_model, merge_params, split_params

Array = jax.Array


def _pow2_at_least(n: int, lo: int = 1) -> int:
  return max(lo, 1 << max(n - 1, 0).bit_length())


def score_positions(rows: Sequence[Sequence[int]], pad_id: int | None) -> np.ndarray:
  """Where each row is scored `[N]`: its last token whose id is not `pad_id` (transformers' rule for
  `*ForSequenceClassification`: 0 when every token is `pad_id`), or its last token when pad_id is None."""
  out = np.zeros(len(rows), np.int32)
  for i, row in enumerate(rows):
    row = np.asarray(row)
    if pad_id is None:
      out[i] = len(row) - 1
    else:
      real = np.flatnonzero(row != pad_id)
      out[i] = real[-1] if len(real) else 0
  return out


def scores_at(config: ModelConfig, prepared: dict, tokens: Array, lengths: Array, positions: Array, *,
              attention: str = "xla", scan_layers: bool = True, remat="none") -> Array:
  """fp32 scores `[B]` of a scalar-head model: the head at `positions` `[B]` of right-padded rows
  `tokens` `[B, T]` (valid up to `lengths` `[B]`). prepared: `prepare_params(params, config.dtype)`.
  Pure and differentiable: the reward model's forward and the one its training differentiates."""
  hidden = scan_hidden_states(config, prepared, tokens, lengths, attention=attention, scan_layers=scan_layers,
                              remat=remat)
  picked = hidden[jnp.arange(hidden.shape[0]), positions]  # [B, E]
  return jnp.einsum("be,e->b", picked, prepared["score"][:, 0].astype(picked.dtype),
                    preferred_element_type=jnp.float32)


class RewardModel:
  """A scalar-head decoder that scores token rows (a reward model) or every position (a critic).

  config: a `ModelConfig` with `num_labels = 1`; params: `split_params` of the model (its HF
  layout; kept only in the compute layout, `prepare_params`), or None for a model of shapes only
  (nothing allocated: `lower_scores` compiles its program for a memory plan). pad_id: the id transformers reads past
  (config.json's `pad_token_id`, else the tokenizer's; None: each row is read at its last token).
  tokenizer: for `score(texts)` (optional). mesh: where it runs (None: the default device).
  """

  def __init__(self, config: ModelConfig, params: dict | None, *, pad_id: int | None = None, tokenizer=None,
               mesh=None, batch_rows: int = 64, min_width: int = 16, attention: str = "auto",
               scan_layers: bool = True):
    if config.num_labels != 1:
      raise ValueError(f"a reward model has one output (num_labels = 1); {config.architecture} has "
                       f"num_labels = {config.num_labels}. Export the reward model with a single score")
    if batch_rows < 1 or min_width < 1:
      raise ValueError(f"batch_rows and min_width must be >= 1, got {batch_rows}, {min_width}")
    self.config, self.pad_id, self.tokenizer, self.mesh = config, pad_id, tokenizer, mesh
    self.min_width = _pow2_at_least(min_width)
    self.max_width = config.max_position_embeddings
    self.batch_divisor = 1 if mesh is None else parallel.batch_divisor(mesh)
    self.batch_rows = max(_pow2_at_least(batch_rows), self.batch_divisor)
    platform = (jax.devices()[0] if mesh is None else mesh.devices.flat[0]).platform
    self.attention = resolve_attention(attention, platform, config.dtype)
    self.scan_layers = scan_layers
    graphdef, shapes = split_params(abstract_model(config))
    self._graphdef = graphdef
    prepare = jax.jit(prepare_params, static_argnums=1)
    shardings = None
    if mesh is not None:
      axes = parallel.logical_axes(abstract_model(config))
      shardings = stacked_shardings(parallel.param_shardings(shapes, axes, mesh), mesh)
      prepare = jax.jit(prepare_params, static_argnums=1, out_shardings=shardings)
      self._rows_sharding = parallel.batch_sharding(mesh, 2)
      self._vec_sharding = parallel.batch_sharding(mesh, 1)
    dtype = jnp.dtype(config.dtype).name
    if params is None:  # shapes (and shardings) only
      self.params = jax.eval_shape(lambda p: prepare(p, dtype), shapes)
      if shardings is not None:
        self.params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                   self.params, shardings)
    else:
      self.params = prepare(params, dtype)  # the compute layout: cast, layers stacked
    # A mesh over several processes (the reward processes of a multi-process run): every process
    # reads every row's score, so the scores `[B]` come out replicated.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) \
        if mesh is not None and mesh.is_multi_process else None
    self._scores = jax.jit(self._scores_impl, out_shardings=replicated)
    self._values = jax.jit(self._values_impl)

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, *, dtype=jnp.float32, mesh=None, tokenizer=None,
                      weights: bool = True, **options) -> "RewardModel":
    """Load an HF `*ForSequenceClassification` directory (one label) in `dtype` (params and compute),
    sharded on `mesh`; its tokenizer too when the directory has one (or pass `tokenizer`). `options`:
    see the class (batch_rows, min_width, attention, scan_layers). weights=False: config.json, the
    tokenizer and the pad id only, params of shapes only (what builds its token rows: `encode`,
    `config.vocab_size`; nothing is allocated on a device)."""
    path = Path(path)
    if weights:
      config, model = hf.load_hf_checkpoint(path, dtype=dtype, mesh=mesh)
    else:
      config_file = path / "config.json"
      if not config_file.is_file():
        raise hf.CheckpointError(f"{config_file} is missing: not a Hugging Face checkpoint directory")
      config, model = hf.config_from_hf(json.loads(config_file.read_text()), source=str(config_file), dtype=dtype), None
    if not config.num_labels:
      raise hf.CheckpointError(f"{path}: {config.architecture} is a causal LM, not a reward model: a reward "
                               f"model is a {config.architecture.replace('ForCausalLM', 'ForSequenceClassification')}"
                               " checkpoint (num_labels = 1)")
    if tokenizer is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
      tokenizer = hf.load_tokenizer(path)
    hf_config = json.loads((path / "config.json").read_text())
    pad_id = hf_config.get("pad_token_id")
    if pad_id is None and tokenizer is not None:
      pad_id = tokenizer.pad_token_id
    if isinstance(pad_id, (list, tuple)):
      pad_id = pad_id[0]
    params = split_params(model)[1] if model is not None else None
    return cls(config, params, pad_id=pad_id, tokenizer=tokenizer, mesh=mesh, **options)

  def save_pretrained(self, path: str | os.PathLike) -> Path:
    """Write an HF directory that `transformers.AutoModelForSequenceClassification` loads (the
    tokenizer too, when there is one)."""
    params = jax.device_get(unstack_layers(self.params))
    return hf.save_hf_checkpoint(merge_params(self._graphdef, params), self.config, path,
                                 tokenizer=self.tokenizer, pad_token_id=self.pad_id)

  # ----------------------------------------------------------------------------------------------
  # device programs

  def _hidden(self, params, tokens, lengths):
    return scan_hidden_states(self.config, params, tokens, lengths, attention=self.attention,
                              scan_layers=self.scan_layers)

  def _scores_impl(self, params, tokens, lengths, positions):
    return scores_at(self.config, params, tokens, lengths, positions, attention=self.attention,
                     scan_layers=self.scan_layers)

  def _values_impl(self, params, tokens, lengths):
    hidden = self._hidden(params, tokens, lengths)
    return jnp.einsum("bte,e->bt", hidden, params["score"][:, 0].astype(hidden.dtype),
                      preferred_element_type=jnp.float32)

  def lower_scores(self, rows: int, width: int):
    """The scoring program of a chunk of `rows` x `width` tokens, lowered (abstract inputs: a model of
    shapes only lowers too); `.compile().memory_analysis()` is what a chunk takes on a device."""
    def arg(shape, dtype):
      sharding = None if self.mesh is None else (self._rows_sharding if len(shape) == 2 else self._vec_sharding)
      return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return self._scores.lower(self.params, arg((rows, width), jnp.int32), arg((rows,), jnp.int32),
                              arg((rows,), jnp.int32))

  @property
  def num_programs(self) -> int:
    """Scoring programs compiled so far (one per chunk shape seen)."""
    return compat.jit_cache_size(self._scores)

  def chunk_shape(self, rows: int, longest: int) -> tuple[int, int]:
    """(rows, width) of the device arrays for `rows` rows of up to `longest` tokens (`score_tokens`
    scores at most `batch_rows` rows at once)."""
    return _pow2_at_least(rows, self.batch_divisor), min(_pow2_at_least(longest, self.min_width), self.max_width)

  # ----------------------------------------------------------------------------------------------
  # host side

  def _check_rows(self, rows) -> list[np.ndarray]:
    rows = [np.asarray(r, np.int32).reshape(-1) for r in rows]
    for i, r in enumerate(rows):
      if len(r) == 0:
        raise ValueError(f"row {i} is empty: a reward model scores at least one token")
      if len(r) > self.max_width:
        raise ValueError(f"row {i} has {len(r)} tokens, more than the reward model's context "
                         f"(max_position_embeddings = {self.max_width}); cut the prompt or the response")
      if r.min() < 0 or r.max() >= self.config.vocab_size:
        raise ValueError(f"row {i} has token ids outside [0, {self.config.vocab_size}) (the reward model's "
                         "vocabulary): score rows of its own tokenizer (re-tokenise the text with `score`)")
    return rows

  def _bucket(self, rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens `[B', T']` (B' rows rounded up to a power of two and the batch divisor, T'
    a power of two from min_width, capped at the context) and lengths `[B']` (padding rows: 1 token)."""
    n, width = self.chunk_shape(len(rows), max(len(r) for r in rows))
    tokens = np.full((n, width), 0 if self.pad_id is None else self.pad_id, np.int32)
    lengths = np.ones(n, np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(r)] = r
      lengths[i] = len(r)
    return tokens, lengths

  def _put(self, x: np.ndarray):
    if self.mesh is None:
      return jnp.asarray(x)
    return jax.device_put(x, self._rows_sharding if x.ndim == 2 else self._vec_sharding)

  def score_tokens(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
    """Scores `[len(rows)]` float32 of token rows of any lengths (each read at its last non-pad token)."""
    if len(rows) == 0:
      return np.zeros(0, np.float32)
    rows = self._check_rows(rows)
    positions = score_positions(rows, self.pad_id)
    order = np.argsort([len(r) for r in rows], kind="stable")
    out = []
    for start in range(0, len(rows), self.batch_rows):
      idx = order[start:start + self.batch_rows]
      tokens, lengths = self._bucket([rows[i] for i in idx])
      pos = np.zeros(len(lengths), np.int32)
      pos[:len(idx)] = positions[idx]
      out.append((idx, self._scores(self.params, self._put(tokens), self._put(lengths), self._put(pos))))
    scores = np.zeros(len(rows), np.float32)
    for idx, chunk_scores in out:  # dispatched above, fetched here: the chunks run back to back
      scores[idx] = np.asarray(chunk_scores)[:len(idx)]
    return scores

  def values(self, tokens, lengths=None) -> np.ndarray:
    """The head at every position `[B, T]` float32 of right-padded `tokens` `[B, T]` (rows valid up
    to `lengths` `[B]`, default T; values past a row's length are not meaningful): the critic's
    V(s_t), the value after reading token t."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2:
      raise ValueError(f"values: tokens must be [batch, tokens], got shape {tokens.shape}")
    B, T = tokens.shape
    lengths = np.full(B, T, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    rows = self._check_rows([tokens[i, :max(int(lengths[i]), 1)] for i in range(B)])
    padded, padded_lengths = self._bucket(rows)
    values = np.asarray(self._values(self.params, self._put(padded), self._put(padded_lengths)))
    return values[:B, :T].astype(np.float32)

  def encode(self, texts: Sequence, prompts: Sequence[str] | None = None) -> list[list[int]]:
    """Token rows of `texts` through this model's tokenizer: each text a string or a conversation (a
    list of {"role", "content"} messages). With `prompts`, text i is the assistant's reply to prompt
    i. A conversation is rendered with the tokenizer's chat template when it has one; without one, a
    prompt and its reply are joined as plain text."""
    tok = self.tokenizer
    if tok is None:
      raise ValueError("this reward model has no tokenizer (its directory has none): pass tokenizer= to "
                       "from_pretrained, or score token rows with score_tokens")
    if prompts is not None and len(prompts) != len(texts):
      raise ValueError(f"{len(texts)} texts but {len(prompts)} prompts")
    rows = []
    for i, text in enumerate(texts):
      messages = text if not isinstance(text, str) else None
      if messages is None and prompts is not None:
        messages = [{"role": "user", "content": prompts[i]}, {"role": "assistant", "content": text}]
      if messages is not None and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
      elif messages is not None:
        ids = tok("".join(m["content"] for m in messages))["input_ids"]
      else:
        ids = tok(text)["input_ids"]
      rows.append(list(ids))
    return rows

  def score(self, texts: Sequence, prompts: Sequence[str] | None = None) -> np.ndarray:
    """Scores `[len(texts)]` of texts (see `encode`), through the model's own tokenizer."""
    return self.score_tokens(self.encode(texts, prompts))
