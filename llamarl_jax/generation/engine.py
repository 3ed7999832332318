"""The slot engine: continuous batching with streaming output and in-flight weight updates.

`Sampler.generate` decodes a static batch: a row that finishes early idles until the longest row of
its batch is done. `SlotEngine` keeps a fixed number of KV-cache slots (static shapes) busy instead:

  slots:   `lanes` (rows a decode step computes) plus `staged_slots`: independent
           sequences (prompts up to Pm = the largest prompt bucket, R = max_new_tokens), each with
           its own position, length, finish state and, per token, the policy version that sampled
           it (`SlotState`), over a paged KV pool (`paged.PageLayout`): a prompt region per group
           (the n samples of a prompt read the same blocks: prefix sharing) and response blocks per
           slot, allocated once.
  insert:  queued prompts are prefilled by one jitted call (pool and slot state donated): G prompts
           right-padded to a bucket length (a fixed G per bucket, `SlotPrograms.insert_groups`;
           fewer prompts are padded with dropped groups) run through the model once, each prompt's KV goes to its
           group's region (one prefill for its n samples), and the first response token of each of
           its slots is sampled from the prompt's last logits. The slots are staged: a decode chunk
           admits them into lanes (FIFO). Regions are handed out at admission and freed when a
           group's last sample is harvested.
  decode:  one jitted call runs up to `chunk_steps` decode steps in a `lax.while_loop` on device (no
           host round trip per token); each step's attention reads only the live blocks of the
           running slots (a flat list of TB entries, TB one of the program set's sizes, picked by the
           host from an upper bound without reading the device), so its bytes follow the live lengths, not Pm + R. It exits
           early when nothing runs or waits, or as soon as enough slots are free for the next
           queued prompt group. Each step computes W lanes: the running slots and, in lanes left
           free, staged ones, admitted on device the step after a lane frees (with staged slots
           beyond the lanes, a finished row is refilled without waiting for the host). W is the
           smallest of the decode widths (`SlotPrograms.widths`: the lanes, then quarterings) that
           holds the busy slots: in a batch's final drain the step computes only its last rows.
  harvest: each chunk's results (`ChunkResult`: done flags, tokens, log-probs, versions) leave the
           device with `copy_to_host_async` while the next chunk runs: `chunks_in_flight` (default
           2) chunks are dispatched before the host blocks on the oldest, so the device has the next
           chunk queued while the host harvests. Finished sequences leave their slots and a prompt's
           n samples are handed out together (a `Completed` group) as soon as the last of them
           finishes: the output streams, it does not wait for the batch. A slot refilled after a
           chunk was dispatched is not harvested from that chunk's (older) result: each slot carries
           a generation number, and a result only counts for the generation it was dispatched with.
  swap:    between chunks `swap(params, version)` installs new weights without dropping sequences.
           The KV cache is kept by default (PipelineRL: earlier positions keep the keys/values of
           the weights that computed them); `recompute_kv=True` re-prefills every running slot's
           prompt + generated tokens under the new weights instead.

Exactness: the model code, the sampling step (`sample_logits`) and the behaviour log-probs are the
static sampler's. Token t of the sample in row r of a request with seed s draws with the key
fold_in(fold_in(key(s), t), r), the key the static sampler uses for row r of a batch sampled with
seed s, so a request samples the same tokens whichever slot, chunk or neighbours it gets, and the
same as `Sampler.generate` on the same prompts and seed. A token's behaviour log-prob is that of
the distribution that actually sampled it: with a kept cache after a swap, that is the new weights
applied on top of the keys/values the old weights wrote (what AIPO's importance weight corrects).

Compilation: the engine's programs are a set fixed by its configuration (`SlotPrograms.program_keys`:
insert per prompt bucket, decode per width and entry size, recompute when swaps recompute; at most 8
at 64 slots, prompts of 1024 and responses of 4096), compiled at construction, concurrently, with a
progress line; nothing compiles afterwards whatever the lengths, groups or swaps. A second engine of
the same configuration in the process takes the first one's programs (`SlotPrograms.shared`), and on
a GPU JAX's persistent compilation cache keeps them across processes (`compile_cache`).
`num_traces` counts traces (tests assert it).

The device programs (insert, decode, recompute over `SlotState` and the KV cache) are
`slot_programs.SlotPrograms`, the chunks in flight and their watcher thread `inflight`; this module
is the host's scheduling around them.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from llamarl_jax import parallel
from llamarl_jax.compile_cache import enable_persistent_cache
from llamarl_jax.batch import FINISH_LENGTH, FINISH_STOP, RolloutBatch
from llamarl_jax.generation.inflight import InFlight, start_watcher
from llamarl_jax.generation.sampler import (DEFAULT_PROMPT_BUCKETS, Sampler, SamplingParams, validate_prompts)
from llamarl_jax.generation.slot_programs import ChunkResult, SlotPrograms, SlotState, token_keys  # noqa: F401
from llamarl_jax.model.config import ModelConfig, WeightLayout

Array = jax.Array


@dataclasses.dataclass
class Completed:
  """A finished prompt group (host numpy): the n samples of one submitted prompt.

  prompt [L]; tokens, logprobs, versions [n, R] (pad / 0 / the first token's version after each
  sample's length); lengths, finish [n]; tag: the caller's tag from `submit`; routing [n, L + R,
  moe layers, k]: a MoE model's experts at each position of [prompt | response] (`SlotState.routing`;
  -1 where no forward ran), None for a dense model.
  """

  tag: Any
  prompt: np.ndarray
  tokens: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  lengths: np.ndarray
  finish: np.ndarray
  routing: np.ndarray | None = None


@dataclasses.dataclass
class _Group:
  uid: int
  prompt: np.ndarray
  key: np.ndarray      # uint32 [K]
  row0: int            # row of sample 0 (sample j samples as row row0 + j)
  version: int | None  # admit only once the engine holds this version (None: any)
  tag: Any
  n: int
  left: int = 0        # samples not yet finished
  region: int = -1     # the prompt region (KV pool) its samples share, from admission until all are harvested
  out: dict = dataclasses.field(default_factory=dict)  # sample j -> (tokens, logprobs, versions, len, stopped, routing)


def rollout_from_groups(groups: Sequence[Completed], *, pad_id: int = 0,
                        prompt_width: int | None = None) -> RolloutBatch:
  """Stack completed groups into a host `RolloutBatch` (group i = rows [i*n, (i+1)*n), group id i).

  Prompts are left-padded to `prompt_width` (default: the longest prompt). `policy_version` is each
  row's first (oldest) token's version; `token_versions` hold the row's version after its length.
  Groups with routing (a MoE model) give `routing` `[B, width + R, moe layers, k]`, the static
  sampler's layout: the prompt's experts at its left-padded positions, then the response's; -1 in
  the padding.
  """
  if not groups:
    raise ValueError("rollout_from_groups needs at least one completed group")
  width = max(len(g.prompt) for g in groups) if prompt_width is None else int(prompt_width)
  if width < max(len(g.prompt) for g in groups):
    raise ValueError(f"prompt_width {width} is shorter than the longest prompt "
                     f"({max(len(g.prompt) for g in groups)} tokens)")
  n = groups[0].tokens.shape[0]
  B, R = len(groups) * n, groups[0].tokens.shape[1]
  pt = np.full((B, width), pad_id, np.int32)
  pm = np.zeros((B, width), np.int32)
  for i, g in enumerate(groups):
    pt[i * n:(i + 1) * n, width - len(g.prompt):] = g.prompt
    pm[i * n:(i + 1) * n, width - len(g.prompt):] = 1
  cat = lambda name: np.concatenate([getattr(g, name) for g in groups], axis=0)
  lengths = cat("lengths").astype(np.int32)
  mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.int32)
  versions = cat("versions").astype(np.int32)
  first = versions[:, 0]
  routing = None
  if groups[0].routing is not None:
    _, _, layers, k = groups[0].routing.shape
    routing = np.full((B, width + R, layers, k), -1, np.int32)
    for i, g in enumerate(groups):
      L = len(g.prompt)
      routing[i * n:(i + 1) * n, width - L:width] = g.routing[:, :L]
      routing[i * n:(i + 1) * n, width:] = g.routing[:, L:]
  return RolloutBatch(
      prompt_tokens=pt, prompt_mask=pm, response_tokens=cat("tokens").astype(np.int32), response_mask=mask,
      behaviour_logprobs=cat("logprobs").astype(np.float32), lengths=lengths,
      finish_reason=cat("finish").astype(np.int32),
      group_ids=np.repeat(np.arange(len(groups), dtype=np.int32), n),
      policy_version=first, token_versions=np.where(mask > 0, versions, first[:, None]).astype(np.int32),
      routing=routing)


class SlotEngine:
  """Continuous-batching generator over `lanes` + `staged_slots` KV-cache slots (see the module docstring).

  config, mesh, pad_id, prompt_buckets, rules: as `Sampler` (slots are sharded over the mesh's data
    axes like the static batch; lanes and staged_slots must be multiples of data x fsdp).
  lanes: rows one decode step computes at most (each a KV slot).
  sampling: temperature, top_k, top_p, max_new_tokens (R), n (samples per prompt) and stop ids of
    every request (they are compiled in); `seed` is per `submit` call.
  max_prompt_len: longest prompt accepted (rounded up to a bucket); the cache holds Pm + R tokens.
  chunk_steps: decode steps per jitted call at most (the host schedules between chunks).
  max_insert: prompt groups prefilled per insert call at most (default: as many as the slots hold);
  prefill_tokens: prompt tokens one insert call prefills at most: a call of prompt bucket Pb takes
    max(1, min(max_insert, prefill_tokens // Pb)) groups (a fixed count per bucket; a call with fewer
    groups pays for the rest: 1024 keeps a streaming insert of a few groups cheap beside a chunk);
  prompt_bucket_count: inserts pad prompts to the largest this many of `prompt_buckets` up to
    max_prompt_len (e.g. 256, 512, 1024 for prompts up to 1024 tokens).
  recompute_kv: the default of `swap`: keep the KV cache (False) or recompute it.
  kv_block_size: positions per block of the paged KV pool (`paged.PageLayout`); a decode step reads
    each running row's blocks, so its bytes follow the live lengths (rounded up to blocks).
  chunks_in_flight: decode chunks dispatched before the host waits for the oldest one's results
    (1 = the host waits for every chunk before dispatching the next; 2 keeps the device busy while
    the host harvests and inserts). The samples do not depend on it (a row's keys do not depend on
    its slot or chunk); with in-flight swaps, which version a token sees does (refills start a chunk
    later), deterministically for a given setting.
  paged_attention: the decode attention's form (`paged_attention.PAGED_IMPLEMENTATIONS`: 'auto',
    'reduce', 'dot', 'pallas', the one-kernel form of `paged_kernel`, or 'pallas_fused', that kernel
    writing the new key and value itself); 'auto' is, on one GPU, the kernel form `gpu_paths` records
    as passed on a GPU (`program_set.decode_attention_choice`), XLA's 'reduce' on a sharded GPU
    mesh, 'dot' on the CPU.
  staged_slots: KV slots beyond the lanes: queued prompts
    are prefilled into them ahead and a decode chunk admits them into lanes as lanes free, on device
    (FIFO), so finished rows are refilled at the next step without a host round trip while staged
    slots last (0: a freed lane waits for the host's insert after it harvested the chunk).
  min_decode_width: the fewest rows a decode chunk computes (`program_set.decode_widths`: the
    lanes, then quarterings; default lanes / 16; lanes: the batch never shrinks). A row's samples do not depend on it (its keys
    and math are per row; tests compare with the static sampler).
  layout: the weights' layout in the programs (`Sampler`'s; default the serving layout, Q/K/V and
    gate/up fused, `model.serving`); `swap` takes the trainer's layout and fuses on the mesh.
  quantize: the weights' precision (`Sampler`'s: None, 'fp8' or 'fp8+lm_head'; the programs compute
    with fp8 weights, `model.fp8`).

  Driving it: `swap(params, version)`; `submit(prompts, seed=..., version=..., tag=...)`; then
  `step()` until `idle`; each step returns the groups that completed. `generate(params, prompts)`
  does all of it for one batch and returns a `RolloutBatch` shaped like `Sampler.generate`'s.
  """

  def __init__(self, config: ModelConfig, mesh: Mesh | None = None, *, lanes: int,
               sampling: SamplingParams = SamplingParams(), max_prompt_len: int = 128, chunk_steps: int = 16,
               pad_id: int = 0, prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS,
               max_insert: int | None = None, recompute_kv: bool = False, chunks_in_flight: int = 2,
               kv_block_size: int = 16, paged_attention: str = "auto", min_decode_width: int | None = None,
               staged_slots: int = 0, prefill_tokens: int = 1024, prompt_bucket_count: int = 3,
               progress: bool = True, rules: Mapping[str, str | None] = parallel.RULES,
               layout: WeightLayout | None = None, quantize: str | None = None):
    self.sampler = Sampler(config, mesh, pad_id=pad_id, prompt_buckets=prompt_buckets, rules=rules, layout=layout,
                           quantize=quantize)
    self.config, self.mesh, self.pad_id = config, self.sampler.mesh, int(pad_id)
    divisor = parallel.batch_divisor(self.mesh)
    if lanes < 1 or lanes % divisor:
      raise ValueError(f"lanes must be a positive multiple of the mesh's data x fsdp size ({divisor}), "
                       f"got {lanes}")
    if staged_slots < 0 or staged_slots % divisor:
      raise ValueError(f"staged_slots must be a non-negative multiple of the mesh's data x fsdp size ({divisor}), "
                       f"got {staged_slots}")
    self.num_lanes = lanes  # rows a decode step computes at most
    num_slots = lanes + staged_slots  # KV slots: the lanes' and the stage's
    if sampling.n > num_slots:
      raise ValueError(f"sampling.n = {sampling.n} samples per prompt need as many slots; lanes + staged_slots "
                       f"is {num_slots}")
    if chunk_steps < 1:
      raise ValueError(f"chunk_steps must be >= 1, got {chunk_steps}")
    if chunks_in_flight < 1:
      raise ValueError(f"chunks_in_flight must be >= 1, got {chunks_in_flight}")
    self.chunks_in_flight = int(chunks_in_flight)
    self.num_slots, self.sampling, self.chunk_steps = num_slots, sampling, int(chunk_steps)
    self.R, self.n = sampling.max_new_tokens, sampling.n
    self.max_prompt_len = self.sampler.prompt_bucket(max_prompt_len)
    self.recompute_kv = recompute_kv
    self.programs = SlotPrograms.shared(
        config, self.sampler, num_slots=num_slots, sampling=sampling, max_prompt_len=self.max_prompt_len,
        chunk_steps=self.chunk_steps, pad_id=self.pad_id, kv_block_size=int(kv_block_size),
        paged_attention=paged_attention, min_decode_width=min_decode_width, num_lanes=self.num_lanes,
        max_insert=max_insert, prefill_tokens=int(prefill_tokens), prompt_bucket_count=int(prompt_bucket_count),
        recompute=bool(recompute_kv))
    self.max_insert = self.programs.max_insert
    enable_persistent_cache(self.programs.platform)
    t = time.perf_counter()
    compiled = self.programs.compile(progress=progress)
    self.warmup_s = time.perf_counter() - t  # compiling (or loading) the program set; 0 when shared
    if progress and not compiled:
      print(f"slot engine: {self.programs.num_compiled} programs, compiled by an engine of the same configuration",
            file=sys.stderr, flush=True)
    self.params, self.version = None, None
    self._cache, self._state = self.programs.empty()
    self._owner: list[tuple[_Group, int] | None] = [None] * num_slots
    self._free_regions = list(range(num_slots))  # prompt regions of the KV pool not held by a group
    # an upper bound on the decode steps each slot has run (paged bound): steps dispatched since its
    # insert, tightened at each harvest to what it had run by then (a staged slot may wait for a lane)
    self._since = np.zeros(num_slots, np.int64)
    self._gen = np.zeros(num_slots, np.int64)  # bumped when a slot is filled: results of older chunks skip it
    self._inflight: collections.deque[InFlight] = collections.deque()
    self._last_chunk: InFlight | None = None  # the last dispatched chunk (device idle time)
    self._gaps: list[tuple[float, InFlight]] = []  # (first dispatch after it, chunk): idle if it was done by then
    self._gap_noted = False  # the first dispatch after the last chunk was noted
    self._watched: queue.SimpleQueue | None = None  # the watcher thread's chunks (started on first dispatch)
    self._queue: collections.deque[_Group] = collections.deque()
    self._uid = 0
    self._seq = 0  # insert order: staged slots are admitted into lanes in it
    self.stats = collections.Counter()

  # -- public ---------------------------------------------------------------------------------------

  def swap(self, params_or_model, version: int, *, recompute_kv: bool | None = None) -> None:
    """Install new weights (between chunks); running sequences continue under them. Weights in
    another dtype than the engine's model config's `param_dtype` are cast to it; weights in the
    trainer's layout are fused into the serving layout on the engine's mesh (`Sampler.place_params`).

    recompute_kv (default: the engine's): re-prefill the running slots' prompt + generated tokens
    under the new weights, so later tokens see no keys/values of the old weights.
    """
    avals = self.programs.param_avals  # the dtypes the programs were compiled for
    self.params = jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype),
                               self.sampler.place_params(params_or_model), avals)
    had = self.version is not None
    self.version = int(version)
    if had and self.num_busy:
      self.stats["swaps_in_flight"] += 1
      if self.recompute_kv if recompute_kv is None else recompute_kv:
        t = time.perf_counter()
        self._cache = self.programs.recompute(self.params, self._cache, self._state)
        jax.block_until_ready(self._cache)
        self.stats["recomputes"] += 1
        self.stats["recompute_s"] += time.perf_counter() - t

  def submit(self, prompts: Sequence[Sequence[int]], *, seed: int = 0, version: int | None = None,
             tags: Sequence[Any] | None = None, n: int | None = None) -> None:
    """Queue prompts (FIFO); each becomes a group of n samples. Prompt i samples as rows i*n..i*n+n-1
    with `seed` (as `Sampler.generate` would); `version`: admit them only once `swap` installed this
    version (or a newer one); until then `step` decodes what is running and admits nothing after
    them, and `wanted_version` says when their admission is due. tags: one per prompt, returned in
    `Completed.tag` (default: the index). n: samples per prompt, at most the engine's
    `sampling.n` (default); a multi-turn episode's next turn is a group of 1 (its whole context).
    """
    n = self.n if n is None else int(n)
    if not 1 <= n <= self.n:
      raise ValueError(f"n = {n} samples per prompt: this engine takes 1..{self.n} (its sampling.n)")
    prompts = validate_prompts(prompts, self.config.vocab_size)
    too_long = [i for i, p in enumerate(prompts) if len(p) > self.max_prompt_len]
    if too_long:
      raise ValueError(f"prompt {too_long[0]} has {len(prompts[too_long[0]])} tokens; this engine takes at most "
                       f"max_prompt_len={self.max_prompt_len}; build it with a larger max_prompt_len")
    if tags is not None and len(tags) != len(prompts):
      raise ValueError(f"got {len(tags)} tags for {len(prompts)} prompts")
    key = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
    for i, p in enumerate(prompts):
      self._queue.append(_Group(self._uid, p.astype(np.int32), key, i * n, version,
                                i if tags is None else tags[i], n))
      self._uid += 1

  def step(self) -> list[Completed]:
    """Admit what fits, dispatch one decode chunk, and harvest the oldest chunk in flight once
    `chunks_in_flight` are (or once nothing more can be dispatched); returns the groups that
    completed (by submit order)."""
    if self.params is None:
      raise RuntimeError("SlotEngine has no weights: call swap(params, version) first")
    self.stats["queue_depth_sum"] += len(self._queue)
    self.stats["schedules"] += 1
    self._admit()
    head = self._queue[0] if self._queue else None
    blocked = head is not None and self._needs(head)
    refill_at = self.num_slots + 1 if head is None or blocked else head.n
    dispatched = False
    if self.num_busy and len(self._inflight) < self.chunks_in_flight:
      busy = np.array([o is not None for o in self._owner])
      width = self.programs.decode_width(int(busy.sum()))  # >= the running slots: busy ones, or all lanes
      num_entries = self.programs.num_entries([len(o[0].prompt) for o in self._owner if o is not None],
                                              self._since[busy], width)
      self._dispatching()
      self._cache, self._state, result = self.programs.decode(
          self.params, self._cache, self._state, np.int32(self.version), np.int32(refill_at),
          width=width, num_entries=num_entries)
      self._since[busy] += self.chunk_steps
      self._last_chunk, self._gap_noted = InFlight(result, self._gen.copy(), bool(self._queue), width), False
      self._inflight.append(self._last_chunk)
      if self._watched is None:
        self._watched = start_watcher(self)  # the thread ends with the engine
      self._watched.put(self._last_chunk)
      self.stats["chunks"] += 1
      dispatched = True
    if self._inflight and (len(self._inflight) >= self.chunks_in_flight or not dispatched):
      return self._harvest(self._inflight.popleft())
    return []

  def run(self, on_wait: Callable[[int], None] | None = None) -> list[Completed]:
    """Step until every queued and running sequence is done; returns the completed groups in order.

    on_wait(version) is called when the head of the queue waits for a version (it should `swap`);
    without it, waiting raises.
    """
    out = []
    while not self.idle:
      if self.wanted_version is not None:
        if on_wait is None:
          raise RuntimeError(f"queued prompts wait for policy version {self.wanted_version}, the engine holds "
                             f"{self.version}; swap it in (or pass on_wait)")
        on_wait(self.wanted_version)
        continue
      out.extend(self.step())
    return out

  def generate(self, params_or_model, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None,
               *, policy_version: int = 0) -> RolloutBatch:
    """`Sampler.generate` through the slots: sample n responses per prompt, rows [i*n, (i+1)*n).

    Same shapes as the static sampler's (P = the prompt bucket of the longest prompt, R), as host
    numpy. `sampling` must equal the engine's except for `seed`.
    """
    sampling = sampling or self.sampling
    if dataclasses.replace(sampling, seed=0) != dataclasses.replace(self.sampling, seed=0):
      raise ValueError(f"this engine samples with {self.sampling} (compiled in); got {sampling}; only the seed "
                       "may differ — build another SlotEngine for other settings")
    if not self.idle:
      raise RuntimeError("generate() needs an idle engine; it has queued or running sequences")
    self.swap(params_or_model, policy_version)
    self.submit(prompts, seed=sampling.seed)
    groups = self.run()
    groups.sort(key=lambda g: g.tag)
    width = self.sampler.prompt_bucket(max(len(p) for p in prompts))
    return rollout_from_groups(groups, pad_id=self.pad_id, prompt_width=width)

  def reset(self) -> None:
    """Drop every queued and running sequence and the weights (a fresh engine, compiled programs kept)."""
    self.params, self.version = None, None
    self._cache, self._state = self.programs.empty()
    self._owner = [None] * self.num_slots
    self._free_regions = list(range(self.num_slots))
    self._since[:] = 0
    self._gen[:] = 0
    self._inflight.clear()
    self._last_chunk, self._gap_noted = None, False
    self._gaps.clear()
    self._queue.clear()
    self.stats = collections.Counter()

  @property
  def num_traces(self) -> int:
    """Traces of the device programs so far (each a compilation): tests bound it."""
    return self.programs.num_traces

  @property
  def wanted_version(self) -> int | None:
    """The version the queue head waits for when its admission is due now (free slots for it), else None."""
    head = self._queue[0] if self._queue else None
    if head is not None and self._needs(head) and self.num_free >= head.n:
      return head.version
    return None

  @property
  def queue_depth(self) -> int:
    """Prompt groups waiting for slots."""
    return len(self._queue)

  @property
  def num_busy(self) -> int:
    """Slots holding a sequence not yet harvested."""
    return sum(o is not None for o in self._owner)

  @property
  def num_free(self) -> int:
    return self.num_slots - self.num_busy

  @property
  def idle(self) -> bool:
    return not self._queue and not self.num_busy and not self._inflight

  def take_metrics(self) -> dict[str, float]:
    """Engine metrics since the last call (then reset): slot utilization, tokens per decode step, ..."""
    self._count_idle()  # gaps whose chunk is still running count in a later period
    s, self.stats = self.stats, collections.Counter()
    steps = max(s["decode_steps"], 1)
    return {
        # useful rows over the rows the decode steps computed (a chunk computes the smallest of the
        # decode widths that holds the busy slots: `SlotPrograms.widths`)
        "generate/slot_utilization": s["useful_slot_steps"] / max(s["computed_slot_steps"], 1),
        # useful rows over every lane at every step (as if the batch never shrank)
        "generate/slot_occupancy": s["useful_slot_steps"] / (steps * self.num_lanes),
        # over the chunks dispatched while prompts waited for slots: a stream's steady state, without
        # the final drain of a finite batch (the last long rows finishing alone)
        "generate/slot_utilization_queued": (s["queued_useful_slot_steps"]
                                             / max(s["queued_computed_slot_steps"], 1)),
        "generate/decode_width_mean": s["computed_slot_steps"] / steps,
        "generate/decode_steps_queued": float(s["queued_decode_steps"]),
        "generate/tokens_per_decode_step": s["useful_slot_steps"] / steps,
        "generate/decode_steps": float(s["decode_steps"]),
        "generate/chunks": float(s["chunks"]),
        "generate/queue_depth_mean": s["queue_depth_sum"] / max(s["schedules"], 1),
        "generate/prefill_calls": float(s["inserts"]),
        "generate/swaps_in_flight": float(s["swaps_in_flight"]),
        # the device's idle time between chunks: from the end of a chunk (the watcher thread's clock)
        # to the host's next dispatch (an insert or a chunk), where the chunk ended before it, while
        # the engine had work (not after it ran out of sequences)
        "time/generate_device_idle": float(s["device_idle_s"]),
        "time/generate_host_wait": float(s["host_wait_s"]),
        "generate/tokens": float(s["first_tokens"] + s["useful_slot_steps"]),
        "time/kv_recompute": float(s["recompute_s"]),
    }

  # -- host scheduling -----------------------------------------------------------------------------

  def _needs(self, g: _Group) -> bool:
    return g.version is not None and (self.version is None or self.version < g.version)

  def _admit(self) -> None:
    """Prefill queued groups (FIFO) into free slots while the head fits and needs no newer weights."""
    free = [s for s, o in enumerate(self._owner) if o is None]
    take: list[tuple[_Group, list[int]]] = []
    while self._queue and len(free) >= self._queue[0].n and not self._needs(self._queue[0]):
      g = self._queue.popleft()
      slots, free = free[:g.n], free[g.n:]
      g.left = g.n
      g.region = self._free_regions.pop(0)  # live groups <= busy slots <= num_slots: never empty
      for j, s in enumerate(slots):
        self._owner[s] = (g, j)
        self._gen[s] += 1
        self._since[s] = 0
      take.append((g, slots))
    batch: list[tuple[_Group, list[int]]] = []
    longest = 0
    for item in take:  # FIFO; a call holds as many groups as its bucket's program takes
      grown = max(longest, len(item[0].prompt))
      if batch and len(batch) + 1 > self.programs.insert_groups[self.programs.prompt_bucket(grown)]:
        self._insert_groups(batch)
        batch, grown = [], len(item[0].prompt)
      batch.append(item)
      longest = grown
    if batch:
      self._insert_groups(batch)

  def _insert_groups(self, items: list[tuple[_Group, list[int]]]) -> None:
    Pb = self.programs.prompt_bucket(max(len(g.prompt) for g, _ in items))
    size = self.programs.insert_groups[Pb]
    tokens = np.full((size, Pb), self.pad_id, np.int32)
    lens = np.ones(size, np.int32)
    dst = np.full((size, self.n), self.num_slots, np.int32)  # out of range: dropped by the scatter
    rows = np.zeros((size, self.n), np.int32)
    keys = np.zeros((size, self.programs.key_words), np.uint32)
    regions = np.full(size, self.num_slots, np.int32)  # padding groups: out of range, dropped
    for i, (g, slots) in enumerate(items):
      regions[i] = g.region
      tokens[i, :len(g.prompt)] = g.prompt
      lens[i] = len(g.prompt)
      dst[i, :len(slots)] = slots  # a group of fewer than n samples: the rest dropped
      rows[i, :g.n] = g.row0 + np.arange(g.n)
      keys[i] = g.key
    self._dispatching()
    seqs = self._seq + np.arange(size, dtype=np.int32)
    self._seq += size
    self._cache, self._state = self.programs.insert(self.params, self._cache, self._state, tokens, lens, dst, rows, keys,
                                               np.int32(self.version), regions, seqs)
    self.stats["inserts"] += 1
    self.stats["first_tokens"] += sum(g.n for g, _ in items)

  def _dispatching(self) -> None:
    """Note the first dispatch after the last chunk: the device idled from that chunk's end until now,
    if it ended before (`_count_idle` knows once the watcher has timed it)."""
    if self._last_chunk is not None and not self._gap_noted:
      self._gaps.append((time.perf_counter(), self._last_chunk))
      self._gap_noted = True

  def _count_idle(self) -> None:
    """Add the idle gaps whose chunks the watcher has timed."""
    keep = []
    for t, chunk in self._gaps:
      if chunk.done_at is None:
        keep.append((t, chunk))
      else:
        self.stats["device_idle_s"] += max(0.0, t - chunk.done_at)
    self._gaps = keep

  def _harvest(self, chunk: "InFlight") -> list[Completed]:
    """Wait for a chunk's results; free the slots whose sequences finished in it (and were filled
    before it was dispatched); return the groups that are now complete."""
    t = time.perf_counter()
    r = chunk.get()
    self.stats["host_wait_s"] += time.perf_counter() - t
    self._count_idle()
    self.stats["decode_steps"] += int(r.steps)
    self.stats["computed_slot_steps"] += int(r.steps) * chunk.width
    self.stats["useful_slot_steps"] += int(r.useful)
    if chunk.queued:
      self.stats["queued_decode_steps"] += int(r.steps)
      self.stats["queued_computed_slot_steps"] += int(r.steps) * chunk.width
      self.stats["queued_useful_slot_steps"] += int(r.useful)
    current = np.array([o is not None and self._gen[s] == chunk.gen[s] for s, o in enumerate(self._owner)])
    later = self.chunk_steps * len(self._inflight)  # steps of the chunks dispatched after this one
    self._since[current] = np.minimum(self._since[current], r.n_gen[current] - 1 + later)
    finished = [s for s, o in enumerate(self._owner)
                if o is not None and r.done[s] and self._gen[s] == chunk.gen[s]]
    if not finished:
      if self.idle:  # nothing left to do: the device's rest until new work arrives is not idle time
        self._last_chunk = None
      return []
    tokens, logprobs, versions, n_gen, stopped = r.tokens, r.logprobs, r.versions, r.n_gen, r.stopped
    completed = []
    for s in finished:
      g, j = self._owner[s]
      self._owner[s] = None
      if r.routing is not None:  # this slot's row to the host, then [prompt (L) | response (R)]
        row = np.asarray(r.routing[s])
        routing = np.concatenate([row[:len(g.prompt)], row[self.programs.max_prompt_len:]])
      else:
        routing = None
      g.out[j] = (tokens[s], logprobs[s], versions[s], int(n_gen[s]), bool(stopped[s]), routing)
      g.left -= 1
      if g.left == 0:
        completed.append(g)
        self._free_regions.append(g.region)  # every sample is done: no later chunk reads the region
    completed.sort(key=lambda g: g.uid)
    if self.idle:  # nothing left to do: the device's rest until new work arrives is not idle time
      self._last_chunk = None
    return [self._completed(g) for g in completed]

  def _completed(self, g: _Group) -> Completed:
    out = [g.out[j] for j in range(g.n)]
    lengths = np.array([o[3] for o in out], np.int32)
    versions = np.stack([o[2] for o in out]).astype(np.int32)
    first = versions[:, :1]
    valid = np.arange(self.R)[None, :] < lengths[:, None]
    return Completed(tag=g.tag, prompt=g.prompt, tokens=np.stack([o[0] for o in out]),
                     logprobs=np.stack([o[1] for o in out]), versions=np.where(valid, versions, first),
                     lengths=lengths,
                     finish=np.array([FINISH_STOP if o[4] else FINISH_LENGTH for o in out], np.int32),
                     routing=None if out[0][5] is None else np.stack([o[5] for o in out]))
