"""The slot engine's device programs: prefill-and-insert, a chunk of decode steps, KV recompute.

`SlotPrograms` holds the jitted functions over the slot state (`SlotState`, the KV cache) and nothing
of the host's scheduling: which prompt goes to which slot, when to swap weights and when to harvest
are `engine.SlotEngine`'s. Each program donates the cache and the state it updates, so the KV cache
is allocated once (`empty`) and updated in place.

Exactness: the model code, the sampling step (`sample_logits`) and the behaviour log-probs are the
static sampler's; token t of row r of a request with seed s draws with fold_in(fold_in(key(s), t), r)
(`token_keys`), the key `Sampler` uses for row r of a batch sampled with seed s.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import parallel
from llamarl_jax.generation.sampler import Sampler, SamplingParams, sample_logits
from llamarl_jax.model.llama import KVCache, ModelConfig, merge_params

Array = jax.Array


@flax.struct.dataclass
class SlotState:
  """Device state of the slots. S = num_slots, R = max_new_tokens, Pm = max prompt length, K = key words.

  cur         int32  [S]     the last sampled token (not yet in the KV cache)
  pos         int32  [S]     its position = the cache slot it is written to by the next decode step
  n_gen       int32  [S]     response tokens sampled so far (cur included)
  done        bool   [S]     not decoding: finished (stop token or R tokens) or never filled
  stopped     bool   [S]     finished by a stop token
  tokens      int32  [S, R]  response tokens (pad after n_gen)
  logprobs    f32    [S, R]  behaviour log-probs (0 after n_gen)
  versions    int32  [S, R]  policy version that sampled each token
  key         uint32 [S, K]  PRNG key data of the slot's request seed
  row         int32  [S]     the sample's row within its request (the static sampler's row index)
  prompt      int32  [S, Pm] the prompt, right-padded (read by the KV recompute)
  prompt_len  int32  [S]
  """

  cur: Array
  pos: Array
  n_gen: Array
  done: Array
  stopped: Array
  tokens: Array
  logprobs: Array
  versions: Array
  key: Array
  row: Array
  prompt: Array
  prompt_len: Array


@flax.struct.dataclass
class ChunkResult:
  """What the host reads after a decode chunk: copies of the slot state's outputs, replicated on the
  mesh (every process can read them), so the state itself can be donated to the next chunk while
  these are still on their way to the host (`copy_to_host_async`).

  steps, useful  int32 []      decode steps run, tokens produced (useful slot-steps)
  done, stopped  bool  [S]
  n_gen          int32 [S]
  tokens, logprobs, versions   [S, R]  as in `SlotState`
  """

  steps: Array
  useful: Array
  done: Array
  stopped: Array
  n_gen: Array
  tokens: Array
  logprobs: Array
  versions: Array


def token_keys(key_data: Array, t: Array, row: Array) -> Array:
  """Per-row PRNG keys `[S]` for token index t `[S]` of row `row` `[S]` under seed keys `key_data [S, K]`.

  fold_in(fold_in(key, t), row): what `Sampler` uses for token t of batch row `row`.
  """
  one = lambda kd, t, r: jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(kd), t), r)
  return jax.vmap(one)(key_data, t, row)


class SlotPrograms:
  """The jitted programs over `num_slots` slots of a KV cache of `max_prompt_len + R` positions.

  sampler: the `Sampler` whose model code, parameter shardings, cache sharding and prompt buckets the
  programs share (`graphdef`, `param_shardings`, `cache_sharding`). sampling: R, n, stop ids and the
  sampling settings (compiled in). `num_traces` counts traces (tests assert compile counts).
  """

  def __init__(self, config: ModelConfig, sampler: Sampler, *, num_slots: int, sampling: SamplingParams,
               max_prompt_len: int, chunk_steps: int, pad_id: int):
    self.config, self.graphdef, self.pad_id = config, sampler.graphdef, int(pad_id)
    self.num_slots, self.sampling, self.chunk_steps = num_slots, sampling, int(chunk_steps)
    self.R, self.max_prompt_len = sampling.max_new_tokens, max_prompt_len
    self.key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    stops = sampling.stop_token_ids
    self._stop_ids = np.array(stops if stops else [-1], np.int32)
    self._top_k = 0 if sampling.top_k >= config.vocab_size else sampling.top_k
    mesh = sampler.mesh
    b1, b2 = parallel.batch_sharding(mesh, 1), parallel.batch_sharding(mesh, 2)
    repl = parallel.replicated(mesh)
    cs = sampler.cache_sharding
    L = config.num_layers
    self.cache_sharding = KVCache(k=(cs,) * L, v=(cs,) * L, index=b1)
    self.state_sharding = SlotState(**{f.name: (b2 if f.name in ("tokens", "logprobs", "versions", "key", "prompt")
                                                else b1) for f in dataclasses.fields(SlotState)})
    psh = sampler.param_shardings
    self.insert = jax.jit(self._insert, donate_argnums=(1, 2),
                          in_shardings=(psh, self.cache_sharding, self.state_sharding) + (repl,) * 6,
                          out_shardings=(self.cache_sharding, self.state_sharding))
    self.decode = jax.jit(self._decode, donate_argnums=(1, 2),
                          in_shardings=(psh, self.cache_sharding, self.state_sharding, repl, repl),
                          out_shardings=(self.cache_sharding, self.state_sharding, repl))
    self.recompute = jax.jit(self._recompute, donate_argnums=(1,),
                             in_shardings=(psh, self.cache_sharding, self.state_sharding),
                             out_shardings=self.cache_sharding)
    self.num_traces = 0

  def empty(self) -> tuple[KVCache, SlotState]:
    """A fresh KV cache and slot state (every slot idle), placed on the mesh: allocated once per engine."""
    S, R, Pm = self.num_slots, self.R, self.max_prompt_len
    cache = KVCache.init(self.config, S, Pm + R)
    cache = cache.replace(index=jnp.zeros((S,), jnp.int32))
    zi = lambda *shape: np.zeros(shape, np.int32)
    state = SlotState(cur=zi(S), pos=zi(S), n_gen=zi(S), done=np.ones(S, bool), stopped=np.zeros(S, bool),
                      tokens=np.full((S, R), self.pad_id, np.int32), logprobs=np.zeros((S, R), np.float32),
                      versions=zi(S, R), key=np.zeros((S, self.key_words), np.uint32), row=zi(S),
                      prompt=np.full((S, Pm), self.pad_id, np.int32), prompt_len=zi(S))
    return jax.device_put(cache, self.cache_sharding), jax.device_put(state, self.state_sharding)

  def _sample(self, keys, logits):
    sp = self.sampling
    return sample_logits(keys, logits, temperature=max(sp.temperature, 1e-6), top_k=self._top_k, top_p=sp.top_p,
                         greedy=sp.greedy)

  def _is_stop(self, tokens):
    return jnp.any(tokens[:, None] == jnp.asarray(self._stop_ids)[None, :], axis=-1)

  def _insert(self, params, cache, state, tokens, lens, dst, rows, keys, version):
    """Prefill prompts `[G, Pb]` (right-padded, lengths [G]) and start samples in slots `dst [G, n]`.

    One forward over the G prompts; each prompt's KV rows [0, Pb) are copied into its n slots
    (positions >= its length hold padding's keys, never attended: a slot attends only below its own
    write position, and decoding overwrites them in order). Out-of-range slots (num_slots) are
    padding groups and are dropped by the scatters.
    """
    self.num_traces += 1
    model = merge_params(self.graphdef, params)
    G, Pb = tokens.shape
    n, R, Pm = dst.shape[1], self.R, self.max_prompt_len
    small = KVCache.init(self.config, G, Pb)
    x, small = model.hidden_states(tokens, jnp.broadcast_to(jnp.arange(Pb, dtype=jnp.int32), (G, Pb)), small)
    last = jnp.take_along_axis(x, (lens - 1)[:, None, None], axis=1)[:, 0]  # [G, E] at each prompt's end
    rep = lambda a: jnp.repeat(a, n, axis=0)  # prompt-major -> one row per target slot [G*n, ...]
    flat = dst.reshape(-1)
    row = rows.reshape(-1)
    key = rep(keys)
    token, logprob = self._sample(token_keys(key, jnp.zeros_like(row), row), rep(model.logits(last)))
    put = lambda old, new: old.at[flat].set(new, mode="drop")
    cache = KVCache(k=tuple(c.at[flat, :Pb].set(rep(s), mode="drop") for c, s in zip(cache.k, small.k)),
                    v=tuple(c.at[flat, :Pb].set(rep(s), mode="drop") for c, s in zip(cache.v, small.v)),
                    index=cache.index)
    stop = self._is_stop(token)
    M = flat.shape[0]
    prompt = jnp.pad(tokens, ((0, 0), (0, Pm - Pb)), constant_values=self.pad_id)
    state = SlotState(
        cur=put(state.cur, token), pos=put(state.pos, rep(lens)), n_gen=put(state.n_gen, jnp.ones(M, jnp.int32)),
        done=put(state.done, stop | (R == 1)), stopped=put(state.stopped, stop),
        tokens=put(state.tokens, jnp.full((M, R), self.pad_id, jnp.int32).at[:, 0].set(token)),
        logprobs=put(state.logprobs, jnp.zeros((M, R), jnp.float32).at[:, 0].set(logprob)),
        versions=put(state.versions, jnp.full((M, R), version, jnp.int32)),
        key=put(state.key, key), row=put(state.row, row), prompt=put(state.prompt, rep(prompt)),
        prompt_len=put(state.prompt_len, rep(lens)))
    return cache, state

  def _decode(self, params, cache, state, version, refill_at):
    """Up to `chunk_steps` decode steps for every running slot, on device.

    Exits early when no slot is running or when `refill_at` slots are free (done), so queued
    prompts get slots without waiting for the chunk's end. Returns (cache, state, `ChunkResult`).
    """
    self.num_traces += 1
    model = merge_params(self.graphdef, params)
    S, R = state.cur.shape[0], self.R
    slots = jnp.arange(S)

    def cond(c):
      i, _, st, _ = c
      return (i < self.chunk_steps) & ~jnp.all(st.done) & (jnp.sum(st.done) < refill_at)

    def body(c):
      i, cache, st, useful = c
      running = ~st.done
      x, cache = model.hidden_states(st.cur[:, None], st.pos[:, None], cache.replace(index=st.pos))
      token, logprob = self._sample(token_keys(st.key, st.n_gen, st.row), model.logits(x[:, 0]))
      col = jnp.where(running, st.n_gen, R)  # finished slots write out of range: dropped
      n_gen = st.n_gen + running
      stop = running & self._is_stop(token)
      st = st.replace(
          cur=jnp.where(running, token, st.cur), pos=st.pos + running, n_gen=n_gen,
          done=st.done | stop | (n_gen >= R), stopped=st.stopped | stop,
          tokens=st.tokens.at[slots, col].set(token, mode="drop"),
          logprobs=st.logprobs.at[slots, col].set(logprob, mode="drop"),
          versions=st.versions.at[slots, col].set(version, mode="drop"))
      return i + 1, cache, st, useful + jnp.sum(running, dtype=jnp.int32)

    steps, cache, state, useful = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, state, jnp.int32(0)))
    result = ChunkResult(steps=steps, useful=useful, done=state.done, stopped=state.stopped, n_gen=state.n_gen,
                         tokens=state.tokens, logprobs=state.logprobs, versions=state.versions)
    return cache, state, result

  def _recompute(self, params, cache, state):
    """A fresh KV cache from every slot's prompt + sampled tokens under `params` (one full prefill).

    Slot s holds prompt[:L] then tokens[:n_gen] at positions 0.. (cur included: the next decode step
    writes the same keys/values for it again); positions past that hold values never attended.
    """
    self.num_traces += 1
    model = merge_params(self.graphdef, params)
    S, Pm = state.prompt.shape
    T = cache.max_len
    j = jnp.arange(T)[None, :]
    L = state.prompt_len[:, None]
    resp = jnp.take_along_axis(state.tokens, jnp.clip(j - L, 0, self.R - 1), axis=1)
    prompt = jnp.pad(state.prompt, ((0, 0), (0, T - Pm)), constant_values=self.pad_id)
    seq = jnp.where(j < L, prompt, resp)
    fresh = KVCache.init(self.config, S, T)
    _, fresh = model.hidden_states(seq, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (S, T)), fresh)
    return fresh.replace(index=cache.index)
