"""The slot engine's device programs: prefill-and-insert, a chunk of decode steps, KV recompute.

`SlotPrograms` holds the jitted functions over the slot state (`SlotState`, the KV cache) and nothing
of the host's scheduling: which prompt goes to which slot, when to swap weights and when to harvest
are `engine.SlotEngine`'s. Each program donates the cache and the state it updates, so the KV cache
is allocated once (`empty`) and updated in place.

KV layout: a paged pool (`paged.KVPages`, `paged.PageLayout`): a prompt region per group (its n
samples share one prefill and read the same blocks), response blocks per slot, and a trash block.
A decode step reads only the live blocks of the running slots: a flat list of TB entries built on
device (`paged.live_entries`) from per-row lengths, TB a static size the host picks per chunk from
the program set (`num_entries`), so the bytes a step reads follow each row's length, not the
cache's maximum (`measure.decode_cost.decode_step_cost` measures it).

The program set (`program_keys`: insert per prompt bucket, decode per width and entry count, the
recompute) is fixed by the configuration and small; `program_set` derives it, picks the paged
attention and holds the decode programs' XLA options. `compile` lowers them all and compiles them
concurrently (XLA releases the GIL), ahead of the first call; `shared` hands a second engine of the
same configuration the first one's programs.

Exactness: the model code, the sampling step (`sample_logits`) and the behaviour log-probs are the
static sampler's; token t of row r of a request with seed s draws with fold_in(fold_in(key(s), t), r)
(`token_keys`), the key `Sampler` uses for row r of a batch sampled with seed s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import os
import sys
import threading
import time

from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import gpu_paths, parallel
from llamarl_jax.generation import paged
from llamarl_jax.generation.paged import KVPages, PageLayout
from llamarl_jax.generation.program_set import (DECODE_COMPILER_OPTIONS, compile_lowered, decode_attention,
                                                decode_widths, entry_plan, insert_plan)
from llamarl_jax.generation.sampler import Sampler, SamplingParams, sample_logits
from llamarl_jax.model import exact
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import KVCache, merge_params
from llamarl_jax.model import paged_attention as paged_attention_module
from llamarl_jax.model.paged_attention import PagedKVCache

Array = jax.Array


@flax.struct.dataclass
class SlotState:
  """Device state of the slots. S = num_slots, R = max_new_tokens, Pm = max prompt length, K = key words.

  cur         int32  [S]     the last sampled token (not yet in the KV cache)
  pos         int32  [S]     its RoPE position (prompt_len + n_gen - 1)
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
  region      int32  [S]     the prompt region (`PageLayout`) of the slot's group
  staged      bool   [S]     prefilled, waiting for a lane: a decode chunk admits it (FIFO by `seq`)
                             as soon as a lane is free, on device (running = not done, not staged)
  seq         int32  [S]     admission order of a staged slot (the host's insert counter)
  routing     int32  [S, Pm + R, moe layers, k]  a MoE model's experts at each position of [prompt
                             (right-padded) | response]: prompt position i from the insert's prefill,
                             response position t from the decode step whose input was token t (the
                             step that sampled t + 1); -1 where no forward ran (padding, the last
                             token). A KV recompute after a swap keeps the recorded experts. None for
                             a dense model.
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
  region: Array
  staged: Array
  seq: Array
  routing: Array | None = None


@flax.struct.dataclass
class ChunkResult:
  """What the host reads after a decode chunk: copies of the slot state's outputs, replicated on the
  mesh (every process can read them), so the state itself can be donated to the next chunk while
  these are still on their way to the host (`copy_to_host_async`).

  steps, useful  int32 []      decode steps run, tokens produced (useful slot-steps)
  done, stopped  bool  [S]
  n_gen          int32 [S]
  tokens, logprobs, versions   [S, R]  as in `SlotState`
  routing        int32 [S, Pm + R, moe layers, k]  as in `SlotState` (None for a dense model); the
                 engine copies only the finished slots' rows to the host (all of it would be 200 MB a
                 chunk at Qwen3-30B-A3B's shapes, 64 slots of 2048 positions, 48 layers x top-8)
  """

  steps: Array
  useful: Array
  done: Array
  stopped: Array
  n_gen: Array
  tokens: Array
  logprobs: Array
  versions: Array
  routing: Array | None = None


def token_keys(key_data: Array, t: Array, row: Array) -> Array:
  """Per-row PRNG keys `[S]` for token index t `[S]` of row `row` `[S]` under seed keys `key_data [S, K]`.

  fold_in(fold_in(key, t), row): what `Sampler` uses for token t of batch row `row`.
  """
  one = lambda kd, t, r: jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(kd), t), r)
  return jax.vmap(one)(key_data, t, row)


# Programs of the configurations built in this process (`SlotPrograms.shared`), most recent last: a
# second engine of a configuration reuses the first one's compiled programs.
_SHARED: "collections.OrderedDict[tuple, SlotPrograms]" = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()
SHARED_PROGRAM_SETS = 8  # configurations kept


class SlotPrograms:
  """The jitted programs over `num_slots` slots of a paged KV pool (prompts up to `max_prompt_len`,
  R response tokens, `kv_block_size` positions per block; see `paged.PageLayout`).

  sampler: the `Sampler` whose model code, parameter shardings, cache sharding and prompt buckets the
  programs share (`graphdef`, `param_shardings`, `cache_sharding`). sampling: R, n, stop ids and the
  sampling settings (compiled in). num_lanes: the rows a decode step computes at most (default
  num_slots; fewer: the other slots are a stage, prefilled ahead and admitted into lanes on device);
  min_decode_width: `decode_widths`. max_insert: prompt groups one insert prefills at most;
  prefill_tokens: prompt tokens one insert prefills at most (an insert of bucket Pb takes
  max(1, min(max_insert, prefill_tokens // Pb)) groups); prompt_bucket_count: how many buckets
  inserts pad to: Pm and the sampler's largest below it; recompute: whether the KV recompute is in the program set.

  The program set (`program_keys`): ('insert', prompt bucket, groups), ('decode', width, entries),
  ('recompute',). `compile` builds it ahead; a call outside it compiles on demand (counted).
  `num_traces` counts traces and `traced` counts them per program key (tests assert both).
  """

  def __init__(self, config: ModelConfig, sampler: Sampler, *, num_slots: int, sampling: SamplingParams,
               max_prompt_len: int, chunk_steps: int, pad_id: int, kv_block_size: int = 16,
               paged_attention: str = "auto", min_decode_width: int | None = None, num_lanes: int | None = None,
               max_insert: int | None = None, prefill_tokens: int = 1024, prompt_bucket_count: int = 3,
               recompute: bool = False):
    self.config, self.graphdef, self.pad_id = config, sampler.graphdef, int(pad_id)
    self.weight_layout = sampler.layout
    self.num_slots, self.sampling, self.chunk_steps = num_slots, sampling, int(chunk_steps)
    self.R, self.max_prompt_len = sampling.max_new_tokens, max_prompt_len
    self.layout = PageLayout(num_slots, max_prompt_len, self.R, int(kv_block_size))
    self.key_words = jax.random.key_data(jax.random.key(0)).shape[-1]
    stops = sampling.stop_token_ids
    self._stop_ids = np.array(stops if stops else [-1], np.int32)
    self._top_k = 0 if sampling.top_k >= config.vocab_size else sampling.top_k
    mesh = sampler.mesh
    self.platform = mesh.devices.flat[0].platform  # the paged attention's form follows the mesh's devices
    self.paged_attention, self.attention_form = decode_attention(paged_attention, mesh)
    self.paths = {"paged_attention": self.attention_form, **({"quantize": "fp8"} if sampler.layout.fp8 else {}),
                  **({"moe_grouped_gemm": config.grouped_gemm} if config.num_experts else {})}
    gpu_paths.announce("slot engine", self.platform, self.paths)
    self.num_lanes = num_slots if num_lanes is None else int(num_lanes)
    if not 1 <= self.num_lanes <= num_slots:
      raise ValueError(f"num_lanes must be in 1..num_slots ({num_slots}), got {num_lanes}")
    self.widths = decode_widths(self.num_lanes, parallel.batch_divisor(mesh), min_decode_width)
    self.entry_plan = entry_plan(self.widths, self.layout, self.attention_form)
    self.prompt_buckets, self.max_insert, self.insert_groups = insert_plan(
        sampler.prompt_buckets, max_prompt_len, num_slots=num_slots, samples=sampling.n,
        prompt_bucket_count=prompt_bucket_count, prefill_tokens=prefill_tokens, max_insert=max_insert)
    self.recompute_in_set = bool(recompute)
    b1, b2 = parallel.batch_sharding(mesh, 1), parallel.batch_sharding(mesh, 2)
    repl = parallel.replicated(mesh)
    cs = sampler.cache_sharding  # [batch, len, kv_heads, head_dim]: the pool keeps its head sharding
    L = config.num_layers
    pool = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, *cs.spec[1:]))
    self.cache_sharding = KVPages(k=(pool,) * L, v=(pool,) * L)
    self.moe_layers = len(config.moe_layers) if config.num_experts else 0  # routing recorded when > 0
    self.state_sharding = SlotState(**{f.name: (b2 if f.name in ("tokens", "logprobs", "versions", "key", "prompt")
                                                else b1) for f in dataclasses.fields(SlotState)
                                       if f.name != "routing"},
                                    routing=parallel.batch_sharding(mesh, 4) if self.moe_layers else None)
    psh = sampler.param_shardings
    self.mesh, self._param_shardings, self._dense_cache_sharding = mesh, psh, cs
    self.param_avals = sampler.param_avals  # the sampler's layout (`serving.serving_layout`: fused projections)
    self._insert_jit = jax.jit(exact.traced_on(self._insert, mesh), donate_argnums=(1, 2),
                               in_shardings=(psh, self.cache_sharding, self.state_sharding) + (repl,) * 8,
                               out_shardings=(self.cache_sharding, self.state_sharding))
    self._decode_jit = jax.jit(exact.traced_on(self._decode, mesh), donate_argnums=(1, 2), static_argnums=(5, 6),
                               in_shardings=(psh, self.cache_sharding, self.state_sharding, repl, repl),
                               out_shardings=(self.cache_sharding, self.state_sharding, repl))
    self._recompute_jit = jax.jit(exact.traced_on(self._recompute, mesh), donate_argnums=(1,),
                                  in_shardings=(psh, self.cache_sharding, self.state_sharding),
                                  out_shardings=self.cache_sharding)
    self.num_traces = 0
    self.traced = collections.Counter()
    self.compile_seconds: dict[tuple, float] = {}  # per program: XLA's compile (wall, concurrent with others)
    self._compiled: dict[tuple, Any] = {}
    self._lock = threading.Lock()

  @property
  def param_shardings(self):
    """The shardings of the parameters the programs take (the sampler's serving layout)."""
    return self._param_shardings

  @property
  def dense_cache_sharding(self):
    """The sharding of a dense `[slots, positions, kv_heads, head_dim]` cache on this mesh."""
    return self._dense_cache_sharding

  @classmethod
  def shared(cls, config: ModelConfig, sampler: Sampler, **kwargs) -> "SlotPrograms":
    """The programs of this configuration, built once per process: an engine of a configuration
    built before (the same model config, mesh, sharding rules, prompt buckets and program settings;
    the sampling seed aside) gets the same object, its compiled programs included."""
    sampling = kwargs["sampling"]
    key = (config, sampler.mesh, tuple(sampler.prompt_buckets), tuple(sorted(sampler.rules.items())), sampler.layout,
           dataclasses.replace(sampling, seed=0),
           tuple(sorted((k, v) for k, v in kwargs.items() if k not in ("sampling", "recompute"))))
    with _SHARED_LOCK:
      programs = _SHARED.pop(key, None)
      if programs is None:
        programs = cls(config, sampler, **kwargs)
      programs.recompute_in_set |= bool(kwargs.get("recompute", False))
      _SHARED[key] = programs
      while len(_SHARED) > SHARED_PROGRAM_SETS:
        _SHARED.popitem(last=False)
    return programs

  # -- the program set --------------------------------------------------------------------------------

  def program_keys(self) -> list[tuple]:
    """The program set: ('insert', prompt bucket, groups) per bucket, ('decode', width, entries) per
    width and entry count, and ('recompute',) when swaps recompute the KV cache."""
    keys = [("insert", b, self.insert_groups[b]) for b in self.prompt_buckets]
    keys += [("decode", w, tb) for w in self.widths for tb in self.entry_plan[w]]
    return keys + ([("recompute",)] if self.recompute_in_set else [])

  def prompt_bucket(self, length: int) -> int:
    """The insert bucket of a prompt of `length` tokens (<= Pm)."""
    for b in self.prompt_buckets:
      if length <= b:
        return b
    raise ValueError(f"a prompt of {length} tokens is longer than this engine's max_prompt_len={self.max_prompt_len}")

  def lower(self, key: tuple):
    """The program `key` (one of `program_keys()`) traced and lowered for this engine's shapes, not compiled."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    cache = jax.eval_shape(lambda: self.layout.empty_pages(self.config))
    state = jax.eval_shape(self.empty_state)
    if key[0] == "insert":
      _, Pb, G = key
      n = self.sampling.n
      return self._insert_jit.lower(self.param_avals, cache, state, i32(G, Pb), i32(G), i32(G, n), i32(G, n),
                                    jax.ShapeDtypeStruct((G, self.key_words), jnp.uint32), i32(), i32(G), i32(G))
    if key[0] == "decode":
      return self._decode_jit.lower(self.param_avals, cache, state, i32(), i32(), key[1], key[2])
    if key[0] == "recompute":
      return self._recompute_jit.lower(self.param_avals, cache, state)
    raise ValueError(f"no program {key}")

  def compile(self, keys: Sequence[tuple] | None = None, *, progress: bool = False) -> int:
    """Lower the programs `keys` (default: the program set) not compiled yet, one after another (a
    trace runs Python), and compile them concurrently (XLA compiles outside the GIL); returns how
    many were compiled. progress: one line on stderr as they finish, with each one's seconds."""
    with self._lock:
      keys = [k for k in (self.program_keys() if keys is None else keys) if k not in self._compiled]
      if not keys:
        return 0
      t0 = time.perf_counter()
      lowered = [(k, self.lower(k)) for k in keys]
      t_lower = time.perf_counter() - t0

      def build(item):
        t = time.perf_counter()
        # exact ops: every program's GEMMs sum K in one pass, the insert's as the decode's and the trainer's
        one_pass = item[0][0] == "decode" or self.config.exact
        exe = compile_lowered(item[1], {**DECODE_COMPILER_OPTIONS, **exact.COMPILER_OPTIONS} if one_pass else None)
        return item[0], exe, time.perf_counter() - t

      workers = max(1, min(len(lowered), os.cpu_count() or 1))
      with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="slot-compile") as pool:
        for done, (k, exe, seconds) in enumerate(pool.map(build, lowered), 1):
          self._compiled[k], self.compile_seconds[k] = exe, seconds
          if progress:
            print(f"\rslot engine: compiled {done}/{len(lowered)} programs ({time.perf_counter() - t0:.1f} s; "
                  f"traced in {t_lower:.1f} s)", end="" if done < len(lowered) else "\n", file=sys.stderr,
                  flush=True)
      return len(lowered)

  @property
  def num_compiled(self) -> int:
    return len(self._compiled)

  def _program(self, key: tuple):
    exe = self._compiled.get(key)
    if exe is None:
      self.compile([key])
      exe = self._compiled[key]
    return exe

  def insert(self, params, cache, state, tokens, lens, dst, rows, keys, version, regions, seqs):
    """The compiled `_insert` of this (prompt bucket, groups) = tokens' shape (cache and state donated)."""
    G, Pb = np.shape(tokens)
    return self._program(("insert", Pb, G))(params, cache, state, tokens, lens, dst, rows, keys, version, regions,
                                            seqs)

  def recompute(self, params, cache, state):
    """The compiled `_recompute` (cache donated)."""
    return self._program(("recompute",))(params, cache, state)

  def empty(self) -> tuple[KVPages, SlotState]:
    """A fresh KV pool and slot state (every slot idle), placed on the mesh: allocated once per engine."""
    cache = jax.jit(lambda: self.layout.empty_pages(self.config), out_shardings=self.cache_sharding)()
    return cache, jax.device_put(self.empty_state(), self.state_sharding)

  def empty_state(self) -> SlotState:
    """The slot state with every slot idle (host numpy)."""
    S, R, Pm = self.num_slots, self.R, self.max_prompt_len
    zi = lambda *shape: np.zeros(shape, np.int32)
    return SlotState(cur=zi(S), pos=zi(S), n_gen=zi(S), done=np.ones(S, bool), stopped=np.zeros(S, bool),
                     tokens=np.full((S, R), self.pad_id, np.int32), logprobs=np.zeros((S, R), np.float32),
                     versions=zi(S, R), key=np.zeros((S, self.key_words), np.uint32), row=zi(S),
                     prompt=np.full((S, Pm), self.pad_id, np.int32), prompt_len=zi(S), region=np.full(S, S, np.int32),
                     staged=np.zeros(S, bool), seq=zi(S),
                     routing=np.full((S, Pm + R, self.moe_layers, self.config.num_experts_per_tok), -1, np.int32)
                     if self.moe_layers else None)

  def num_entries(self, prompt_lens: np.ndarray, steps_dispatched: np.ndarray, width: int | None = None) -> int:
    """The entry count (`decode(..., num_entries=)`) of the next chunk of `width` lanes: the smallest
    of the width's (`entry_plan`) that holds the chunk's bound (host numpy, no device read).

    prompt_lens, steps_dispatched `[busy]`: each busy slot's prompt length and decode steps
    dispatched since its insert (`paged.live_blocks_bound`; a staged slot's count is an over-estimate)."""
    width = self.num_lanes if width is None else int(width)
    need = paged.live_blocks_bound(self.layout, prompt_lens, steps_dispatched, self.chunk_steps, width)
    return paged.entry_bucket(need, self.entry_plan[width])

  def decode_width(self, busy: int) -> int:
    """The lanes the next decode chunk computes for `busy` busy slots (running or staged): the
    smallest of `widths` that holds them, at most `num_lanes` (host, no device read)."""
    return min((w for w in self.widths if w >= busy), default=self.num_lanes)

  def _sample(self, keys, logits):
    sp = self.sampling
    return sample_logits(keys, logits, temperature=max(sp.temperature, 1e-6), top_k=self._top_k, top_p=sp.top_p,
                         greedy=sp.greedy, exact=self.config.exact)

  def _is_stop(self, tokens):
    return jnp.any(tokens[:, None] == jnp.asarray(self._stop_ids)[None, :], axis=-1)

  def _insert(self, params, cache, state, tokens, lens, dst, rows, keys, version, regions, seqs):
    """Prefill prompts `[G, Pb]` (right-padded, lengths [G]) and stage samples in slots `dst [G, n]`
    (admission order `seqs [G]`: a decode chunk admits staged slots into its lanes FIFO).

    One forward over the G prompts; prompt g's keys/values of positions [0, Pb) go to the first
    ceil(Pb / bs) blocks of its prompt region `regions[g]`, which its n slots then all read (prefix
    sharing; positions >= its length hold padding's keys, never read: entries list only L of them).
    Out-of-range slots and regions (num_slots) are padding groups, dropped by the scatters.
    """
    G, Pb = tokens.shape
    self.num_traces += 1
    self.traced["insert", Pb, G] += 1
    model = merge_params(self.graphdef, params)
    n, R, Pm = dst.shape[1], self.R, self.max_prompt_len
    small = KVCache.init(self.config, G, Pb)
    x, small, topk = model.routed_hidden_states(tokens, jnp.broadcast_to(jnp.arange(Pb, dtype=jnp.int32), (G, Pb)),
                                                small, mesh=self.mesh)
    last = jnp.take_along_axis(x, (lens - 1)[:, None, None], axis=1)[:, 0]  # [G, E] at each prompt's end
    rep = lambda a: jnp.repeat(a, n, axis=0)  # prompt-major -> one row per target slot [G*n, ...]
    flat = dst.reshape(-1)
    row = rows.reshape(-1)
    key = rep(keys)
    token, logprob = self._sample(token_keys(key, jnp.zeros_like(row), row), rep(model.logits(last)))
    put = lambda old, new: old.at[flat].set(new, mode="drop")
    bs = self.layout.block_size
    nb = -(-Pb // bs)
    blocks = self.layout.region_blocks(regions, nb)  # [G, nb]

    def to_blocks(x):  # [G, Pb, KV, D] -> [G, nb, bs, KV, D]
      x = jnp.pad(x, ((0, 0), (0, nb * bs - Pb), (0, 0), (0, 0)))
      return x.reshape(G, nb, bs, *x.shape[2:])

    put_blocks = lambda pool, x: pool.at[blocks].set(to_blocks(x).astype(pool.dtype), mode="drop")
    cache = KVPages(k=tuple(map(put_blocks, cache.k, small.k)), v=tuple(map(put_blocks, cache.v, small.v)))
    stop = self._is_stop(token)
    M = flat.shape[0]
    prompt = jnp.pad(tokens, ((0, 0), (0, Pm - Pb)), constant_values=self.pad_id)
    state = SlotState(
        cur=put(state.cur, token), pos=put(state.pos, rep(lens)), n_gen=put(state.n_gen, jnp.ones(M, jnp.int32)),
        done=put(state.done, stop | (R == 1)), stopped=put(state.stopped, stop),
        staged=put(state.staged, ~(stop | (R == 1))), seq=put(state.seq, rep(seqs)),
        tokens=put(state.tokens, jnp.full((M, R), self.pad_id, jnp.int32).at[:, 0].set(token)),
        logprobs=put(state.logprobs, jnp.zeros((M, R), jnp.float32).at[:, 0].set(logprob)),
        versions=put(state.versions, jnp.full((M, R), version, jnp.int32)),
        key=put(state.key, key), row=put(state.row, row), prompt=put(state.prompt, rep(prompt)),
        prompt_len=put(state.prompt_len, rep(lens)), region=put(state.region, rep(regions)),
        routing=None if topk is None else put(state.routing, rep(self._prompt_routing(topk, lens))))
    return cache, state

  def _prompt_routing(self, topk, lens):
    """A prefill's experts `[G, Pb, moe layers, k]` of prompts of `lens` `[G]` as `SlotState.routing`
    rows `[G, Pm + R, moe layers, k]`: the prompt's positions, -1 past its length and in the response."""
    G, Pb = topk.shape[:2]
    real = (jnp.arange(Pb)[None] < lens[:, None])[:, :, None, None]
    topk = jnp.where(real, topk, -1)
    return jnp.pad(topk, ((0, 0), (0, self.max_prompt_len + self.R - Pb), (0, 0), (0, 0)), constant_values=-1)

  def decode_step(self, model, cache: KVPages, state: SlotState, version,
                  num_entries: int) -> tuple[KVPages, SlotState]:
    """One decode step of every slot, traceable: (cache, state). `model`: the engine's (`merge_params` of
    its graph and params) or any with its `hidden_states` / `logits` interface over a paged cache."""
    return self._step(model, cache, state, version, num_entries)[:2]

  def _step(self, model, cache: KVPages, st: SlotState, version, num_entries: int, slot=None):
    """One decode step of every running row of `st` (W rows: every slot, or the rows of slots `slot
    [W]`): (cache, state, running `[W]`). The step reads the `num_entries` (TB) listed blocks
    (`paged.live_entries`) and writes each running row's current token into its slot's response
    block; idle rows write to the trash block. (A dense `KVCache` of `[S, Pm + R]` per layer, the
    layout before pages, is taken too: `measure.decode_cost` compares.)"""
    S, R = st.cur.shape[0], self.R
    slots = jnp.arange(S)
    running = ~st.done
    # a MoE model's expert layers run over the mesh (`moe.grouped_swiglu`: expert parallelism)
    forward = model.hidden_states if st.routing is None else (
        lambda *a: model.routed_hidden_states(*a, mesh=self.mesh))
    if isinstance(cache, KVCache):  # every row attends over all Pm + R cached positions
      x, cache, *topk = forward(st.cur[:, None], st.pos[:, None], cache.replace(index=st.pos))
    else:
      write_block, write_offset = self.layout.write_location(st.n_gen, running, slot)
      row, block, length = paged.live_entries(self.layout, st.region, st.prompt_len, st.n_gen, running,
                                              num_entries, slot)
      pages = PagedKVCache(k=cache.k, v=cache.v, write_block=write_block, write_offset=write_offset,
                           entry_row=row, entry_block=block, entry_len=length)
      with paged_attention_module.target_platform(self.platform, self.paged_attention):
        x, pages, *topk = forward(st.cur[:, None], st.pos[:, None], pages)
      cache = KVPages(k=pages.k, v=pages.v)
    token, logprob = self._sample(token_keys(st.key, st.n_gen, st.row), model.logits(x[:, 0]))
    col = jnp.where(running, st.n_gen, R)  # finished slots write out of range: dropped
    # the experts of the step's input, response token n_gen - 1 (finished slots: out of range, dropped)
    routed_at = jnp.where(running, self.max_prompt_len + st.n_gen - 1, self.max_prompt_len + R)
    n_gen = st.n_gen + running
    stop = running & self._is_stop(token)
    st = st.replace(
        cur=jnp.where(running, token, st.cur), pos=st.pos + running, n_gen=n_gen,
        done=st.done | stop | (n_gen >= R), stopped=st.stopped | stop,
        tokens=st.tokens.at[slots, col].set(token, mode="drop"),
        logprobs=st.logprobs.at[slots, col].set(logprob, mode="drop"),
        versions=st.versions.at[slots, col].set(version, mode="drop"))
    if topk:
      st = st.replace(routing=st.routing.at[slots, routed_at].set(topk[0][:, 0], mode="drop"))
    return cache, st, running

  def decode(self, params, cache, state, version, refill_at, *, width: int | None = None, num_entries: int):
    """The compiled `_decode` of (width, num_entries) (cache and state donated).

    width: the lanes (rows) the chunk computes per step, one of `widths` (default the most,
    `num_lanes`); it must be >= the slots running when the chunk starts. num_entries: one of the
    width's `entry_plan`, at least the blocks the chunk's steps read (`num_entries()`)."""
    width = self.num_lanes if width is None else int(width)
    if width not in self.widths:
      raise ValueError(f"width must be one of the decode widths {self.widths}, got {width}")
    return self._program(("decode", width, int(num_entries)))(params, cache, state, version, refill_at)

  def _lanes(self, st: SlotState, width: int) -> Array:
    """The W slots the next step computes: every running slot, then staged ones by `seq` (FIFO), then
    idle ones (int32 `[W]`). W >= the running slots (the host's width, and admission only into lanes)."""
    running = ~st.done & ~st.staged
    waiting = ~st.done & st.staged
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(running, -1, jnp.where(waiting, st.seq, big))
    return jnp.argsort(key, stable=True)[:width].astype(jnp.int32)

  def _decode(self, params, cache, state, version, refill_at, width: int, num_entries: int):
    """Up to `chunk_steps` decode steps of the running slots, `width` (W) rows per step, on device.

    Lanes: each step computes W rows, the running slots' and, in the lanes left, staged slots'
    (prefilled by `insert`), admitted in insert order the step after a lane frees: a finished row is
    refilled on device, with no host round trip, while staged slots last. W = all slots: every
    staged slot is admitted at the chunk's start and rows are slots. W < slots (a stage beyond the
    lanes, or few busy slots: the batch shrinks): the lanes' state is gathered into W rows (each row
    writes its own slot's blocks, reads its region's) and scattered back whenever a lane is refilled
    and at the chunk's end. Exits early when nothing runs or waits, or when `refill_at` slots are
    free (done) and no staged slot waits, so the host can insert queued prompts. `num_entries`
    (static): the entry bucket of the chunk (`num_entries()`: at least the blocks any W lanes
    read). Returns (cache, state, `ChunkResult`).
    """
    S, W = self.num_slots, width
    self.num_traces += 1
    self.traced["decode", W, num_entries] += 1
    model = merge_params(self.graphdef, params)
    gather = lambda full, slot: jax.lax.with_sharding_constraint(
        jax.tree.map(lambda x: jnp.take(x, slot, axis=0), full), self.state_sharding)
    scatter = lambda full, slot, rows: jax.tree.map(lambda f, r: f.at[slot].set(r), full, rows)

    def relane(full, rows, slot):  # rows back into the state; the next lanes gathered, staged ones admitted
      full = scatter(full, slot, rows)
      slot = self._lanes(full, W)
      full = full.replace(staged=full.staged.at[slot].set(False))
      return full, gather(full, slot), slot

    if W == S:  # every slot is a lane: admit every staged slot now (no later insert inside the chunk)
      state = state.replace(staged=jnp.zeros_like(state.staged))
      rows, slot = state, jnp.arange(S, dtype=jnp.int32)
    else:
      slot = self._lanes(state, W)
      state = state.replace(staged=state.staged.at[slot].set(False))
      rows = gather(state, slot)

    def free(full, rows, slot):  # done slots: outside the lanes (the state) plus the lanes' own
      if W == S:
        return jnp.sum(rows.done)
      return jnp.sum(full.done) - jnp.sum(full.done[slot]) + jnp.sum(rows.done)

    def cond(c):
      i, _, full, rows, slot, _ = c
      waiting = jnp.any(full.staged & ~full.done) if W < S else False
      # exit for the host's insert only once no staged slot waits (while one does, lanes are refilled here)
      return (i < self.chunk_steps) & (~jnp.all(rows.done) | waiting) & ((free(full, rows, slot) < refill_at) | waiting)

    def body(c):
      i, cache, full, rows, slot, useful = c
      cache, rows, running = self._step(model, cache, rows, version, num_entries, None if W == S else slot)
      if W < S:  # a lane finished and a staged slot waits: refill it (on device)
        refill = jnp.any(rows.done) & jnp.any(full.staged & ~full.done)
        full, rows, slot = jax.lax.cond(refill, relane, lambda f, r, s: (f, r, s), full, rows, slot)
      return i + 1, cache, full, rows, slot, useful + jnp.sum(running, dtype=jnp.int32)

    steps, cache, state, rows, slot, useful = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, state, rows, slot, jnp.int32(0)))
    state = rows if W == S else scatter(state, slot, rows)
    result = ChunkResult(steps=steps, useful=useful, done=state.done, stopped=state.stopped, n_gen=state.n_gen,
                         tokens=state.tokens, logprobs=state.logprobs, versions=state.versions,
                         routing=state.routing)
    return cache, state, result

  def _recompute(self, params, cache, state):
    """The running slots' keys/values recomputed under `params`: one dense forward of each slot's
    prompt[:L] + tokens[:n_gen] (positions 0..), then scattered into the pool.

    Response entries go to the slot's own blocks (cur included: the next decode step writes it again;
    entries past n_gen hold values never read). The prompt goes to the group's region, written by
    the group's lowest running slot only (its samples' prompt keys are the same). Slots not running
    write nothing: their region may belong to another group by now.
    """
    self.num_traces += 1
    self.traced["recompute",] += 1
    model = merge_params(self.graphdef, params)
    lay = self.layout
    S, Pm = state.prompt.shape
    bs, pb, rb = lay.block_size, lay.prompt_blocks, lay.response_blocks
    T = max(Pm + self.R, pb * bs)
    j = jnp.arange(T)[None, :]
    L = state.prompt_len[:, None]
    resp = jnp.take_along_axis(state.tokens, jnp.clip(j - L, 0, self.R - 1), axis=1)
    prompt = jnp.pad(state.prompt, ((0, 0), (0, T - Pm)), constant_values=self.pad_id)
    seq = jnp.where(j < L, prompt, resp)
    fresh = KVCache.init(self.config, S, T)
    _, fresh = model.hidden_states(seq, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (S, T)), fresh,
                                   mesh=self.mesh)

    slots = jnp.arange(S, dtype=jnp.int32)
    running = ~state.done
    region = jnp.where(running, state.region, S)  # not running: no region
    first = jax.ops.segment_min(jnp.where(running, slots, S), region, num_segments=S)  # [regions]
    writer = running & (jnp.take(first, jnp.minimum(region, S - 1)) == slots)
    prompt_dst = lay.region_blocks(jnp.where(writer, region, S), pb)  # [S, pb]
    resp_dst = lay.response_block_ids(jnp.where(running, slots, S))  # [S, rb]
    resp_at = jnp.clip(L + jnp.arange(rb * bs)[None, :], 0, T - 1)  # [S, rb * bs]: response entry -> position

    def scatter(pool, x):  # x [S, T, KV, D]
      p = x[:, :pb * bs].reshape(S, pb, bs, *x.shape[2:])
      r = jnp.take_along_axis(x, resp_at[:, :, None, None], axis=1).reshape(S, rb, bs, *x.shape[2:])
      pool = pool.at[prompt_dst].set(p.astype(pool.dtype), mode="drop")
      return pool.at[resp_dst].set(r.astype(pool.dtype), mode="drop")

    return KVPages(k=tuple(map(scatter, cache.k, fresh.k)), v=tuple(map(scatter, cache.v, fresh.v)))
