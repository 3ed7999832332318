"""Step-time and memory model for LlamaRL-style RL post-training: a plan on paper, in code.

Pure Python (no JAX): given a Llama 3 shape, a GPU count, per-executor layouts, hardware numbers and
a few achieved-efficiency factors, predict

  * the synchronous step (the paper's DeepSpeed-Chat-like baseline): generator and trainer are
    colocated on all GPUs and take turns, generate -> train -> reshard, in sequence;
  * the asynchronous step (LlamaRL): generator and trainer on disjoint GPU sets run at the same time,
    the step is the slower of the two plus the exposed weight sync;
  * the weight-sync time (DDMA analogue): the generator's bf16/fp8 copy moved trainer -> generator,
    every shard in parallel over the per-GPU network link;
  * the per-device memory plan (params, grads, fp32 Adam, remat activations, KV cache) and whether it
    fits in HBM; `choose_layout` picks meshes that fit and are fastest.

The model of each phase (all assumptions are here and in the function docstrings):

  train     FLOPs = (6 + 2 * remat) * N_matmul * tokens + attention, at `Efficiency.mfu` of the dense
            bf16 peak, slowed by the pipeline bubble (pp - 1) / (microbatches + pp - 1). Tokens are
            packed: prompts x samples x (prompt_len + mean response). FSDP traffic overlaps compute.
  decode    one token for every sequence of a replica per step; a step reads the replica's weights
            and its KV cache from HBM at `Efficiency.hbm` of peak bandwidth, or is FLOP-bound, plus two
            all-reduces per layer (tp > 1) and a hop per pipeline stage. Pipeline stages of one replica
            run one after the other for a token (a training layout reused for decoding, as colocated
            systems do, leaves pp - 1 of every pp GPUs idle).
  generate  synchronous: static batches, every batch lasts as long as its longest response
            (`Workload.response_max` steps), as many waves as the KV cache allows. Asynchronous:
            continuous batching streams prompts, a batch costs its mean length (`response_mean`).
  sync      bytes of the generator's copy (2 bytes/param bf16, 1 fp8) received per generator GPU
            (params / model-parallel size) and sent per trainer GPU (params x replicas / trainer GPUs),
            over the per-GPU network link at `Efficiency.link`; all shards move in parallel.

Calibration (`CALIBRATED`): one set of constants for all three sizes, chosen so that the paper's six
published step times are reproduced within 25% (see `PAPER` and `python -m llamarl_jax.perf_model`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

GB = 1e9


# ------------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class ModelShape:
  """A Llama 3 architecture (untied embeddings, GQA)."""

  name: str
  layers: int
  hidden: int
  heads: int
  kv_heads: int
  intermediate: int
  vocab: int = 128256

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads

  @property
  def layer_params(self) -> int:
    d, hd = self.hidden, self.head_dim
    return d * hd * (2 * self.heads + 2 * self.kv_heads) + 3 * d * self.intermediate + 2 * d

  @property
  def params(self) -> int:
    return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden

  @property
  def matmul_params(self) -> int:
    """Parameters that take part in a matmul per token (all but the embedding table, a gather)."""
    return self.params - self.vocab * self.hidden

  def kv_bytes_per_token(self, nbytes: int = 2) -> int:
    """K and V of every layer for one token, all kv heads."""
    return 2 * self.layers * self.kv_heads * self.head_dim * nbytes

  def attention_flops_per_token(self, context: float) -> float:
    """Forward FLOPs of q.k and p.v for one token attending to `context` tokens."""
    return 4 * self.layers * self.hidden * context


LLAMA3 = {
    "8b": ModelShape("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336),
    "70b": ModelShape("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672),
    "405b": ModelShape("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, intermediate=53248),
}


@dataclass(frozen=True)
class Hardware:
  """An H100 SXM 80 GB cluster: 8 GPUs per node on NVLink 4, one 400 Gb/s NIC per GPU."""

  peak_flops: float = 989e12  # dense bf16
  fp8_speedup: float = 2.0  # dense fp8 / bf16 peak
  hbm_bandwidth: float = 3.35e12
  hbm_bytes: float = 80 * GB
  nvlink_bandwidth: float = 450 * GB  # per GPU, one direction (900 GB/s bidirectional)
  network_bandwidth: float = 50 * GB  # per GPU, one direction (400 Gb/s InfiniBand)
  gpus_per_node: int = 8


@dataclass(frozen=True)
class Efficiency:
  """The calibration: achieved fractions of peak and fixed latencies, the same for every model size."""

  mfu: float = 0.40  # training: model FLOPs / (GPUs x peak)
  hbm: float = 0.60  # decode: achieved / peak HBM bandwidth
  link: float = 0.70  # achieved / peak NVLink or network bandwidth
  nvlink_latency: float = 2e-6  # one ring step between GPUs of a node (s)
  network_latency: float = 8e-6  # one ring step between nodes (s)
  step_overhead: float = 1.0  # per RL step: scoring, orchestration, host work (s)
  decode_overhead: float = 0.0  # per decode step: sampling, scheduling, launch (s)
  usable_memory: float = 0.90  # of HBM, the rest is CUDA context, NCCL buffers, fragmentation


@dataclass(frozen=True)
class Workload:
  """One RL step: `prompts x samples` sequences, `prompt_len` prompt tokens each."""

  prompts: int = 256
  samples: int = 8
  prompt_len: int = 512
  response_mean: int = 1024
  response_max: int = 4096
  microbatch_tokens: int = 16384  # per trainer data-parallel rank and pipeline microbatch

  @property
  def sequences(self) -> int:
    return self.prompts * self.samples

  @property
  def train_tokens(self) -> int:
    """Packed tokens the trainer sees per step (prompt + response, no padding)."""
    return self.sequences * (self.prompt_len + self.response_mean)

  @property
  def max_len(self) -> int:
    return self.prompt_len + self.response_max


@dataclass(frozen=True)
class TrainerLayout:
  """fsdp x tp x pp (x dp replicas of that): tp innermost inside a node, pp across nodes."""

  fsdp: int = 1
  tp: int = 1
  pp: int = 1
  dp: int = 1

  @property
  def gpus(self) -> int:
    return self.dp * self.fsdp * self.tp * self.pp

  @property
  def model_parallel(self) -> int:
    return self.tp * self.pp

  def __str__(self) -> str:
    parts = [f"fsdp{self.fsdp}", f"tp{self.tp}"] + ([f"pp{self.pp}"] if self.pp > 1 else []) + (
        [f"dp{self.dp}"] if self.dp > 1 else [])
    return "x".join(parts) + f" ({self.gpus} GPUs)"


@dataclass(frozen=True)
class GeneratorLayout:
  """`replicas` independent engines, each tp x pp GPUs, weights in `dtype` ('bf16' or 'fp8')."""

  tp: int = 1
  replicas: int = 1
  pp: int = 1
  dtype: str = "bf16"

  @property
  def gpus(self) -> int:
    return self.replicas * self.tp * self.pp

  @property
  def model_parallel(self) -> int:
    return self.tp * self.pp

  @property
  def weight_bytes(self) -> int:
    return {"bf16": 2, "fp8": 1}[self.dtype]

  def __str__(self) -> str:
    mp = f"tp{self.tp}" + (f"xpp{self.pp}" if self.pp > 1 else "")
    return f"{mp} x {self.replicas} replicas {self.dtype} ({self.gpus} GPUs)"


# ------------------------------------------------------------------------------------------------
# communication


def collective_seconds(nbytes: float, group: int, hw: Hardware, eff: Efficiency, *, across_nodes: bool,
                       volume: float = 2.0) -> float:
  """Ring collective over `group` GPUs: volume * (g - 1) steps, each a hop latency plus 1/g of the bytes.

  volume 2 is an all-reduce, 1 an all-gather or reduce-scatter, 0.5 a point-to-point send. A ring that
  spans nodes steps at the pace of its network hops.
  """
  if group <= 1:
    return 0.0
  bandwidth = (hw.network_bandwidth if across_nodes else hw.nvlink_bandwidth) * eff.link
  hop = eff.network_latency if across_nodes else eff.nvlink_latency
  steps = volume * (group - 1)
  return steps * (hop + nbytes / group / bandwidth)


# ------------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class MemoryPlan:
  """Bytes per GPU by kind, against the usable HBM budget."""

  role: str
  budget: float
  params: float = 0.0  # trainer master weights (and resident bf16 working copies)
  grads: float = 0.0
  optimizer: float = 0.0  # fp32 Adam first and second moments
  activations: float = 0.0  # remat checkpoints + one layer recomputed + logits
  gen_weights: float = 0.0  # the generator's bf16 / fp8 copy
  kv_cache: float = 0.0

  @property
  def total(self) -> float:
    return self.params + self.grads + self.optimizer + self.activations + self.gen_weights + self.kv_cache

  @property
  def fits(self) -> bool:
    return self.total <= self.budget

  def __str__(self) -> str:
    parts = [(k, getattr(self, k)) for k in ("params", "grads", "optimizer", "activations", "gen_weights",
                                             "kv_cache")]
    body = " ".join(f"{k}={v / GB:.1f}" for k, v in parts if v)
    verdict = "fits" if self.fits else "DOES NOT FIT"
    return f"{self.role}: {body} total={self.total / GB:.1f}/{self.budget / GB:.0f} GB {verdict}"


def trainer_state_bytes(model: ModelShape, layout: TrainerLayout) -> tuple[float, float, float]:
  """(params, grads, optimizer) bytes per GPU that live across steps.

  pp == 1: ZeRO-3 / FSDP: fp32 master weights, fp32 grads and fp32 Adam (m, v) all sharded over
  fsdp x tp. pp > 1: ZeRO-1 inside each stage (Megatron style): the stage's bf16 weights and fp32
  grads resident, fp32 master + Adam sharded over fsdp.
  """
  n, mp = model.params, layout.model_parallel
  shard = layout.fsdp * mp
  if layout.pp == 1:
    return 4 * n / shard, 4 * n / shard, 8 * n / shard
  return 2 * n / mp + 4 * n / shard, 4 * n / mp, 8 * n / shard


def microbatch_tokens(layout: TrainerLayout, work: Workload) -> int:
  """Tokens of one microbatch on one data-parallel rank: `work.microbatch_tokens`, or all its tokens."""
  return max(1, min(work.microbatch_tokens, math.ceil(work.train_tokens / (layout.dp * layout.fsdp))))


def trainer_activation_bytes(model: ModelShape, layout: TrainerLayout, work: Workload, remat: bool = True) -> float:
  """Activations per GPU for one microbatch (sequence parallel over tp).

  remat: only each layer's input is kept ([tokens, hidden] bf16), plus one layer's recomputed internals
  (~10 hidden + 4 intermediate wide, flash attention) and fp32 logits and their gradient. Without remat
  every layer keeps its internals. With pp, 1F1B keeps pp microbatches of L / pp layers in flight: the
  same L layers' worth. FSDP adds the bf16 copies of the two layers being gathered (transient, like
  the activations: freed before generation in colocated mode).
  """
  t, d, f = microbatch_tokens(layout, work), model.hidden, model.intermediate
  per_layer_internal = t * (10 * d + 4 * f) * 2
  kept = model.layers * t * d * 2 + per_layer_internal if remat else model.layers * per_layer_internal
  logits = 2 * t * model.vocab * 4
  gathered = 2 * 2 * model.layer_params if layout.fsdp > 1 and layout.pp == 1 else 0  # FSDP prefetch: 2 bf16 layers
  return (kept + logits + gathered) / layout.tp


def trainer_memory(model: ModelShape, layout: TrainerLayout, work: Workload, hw: Hardware, eff: Efficiency,
                   remat: bool = True) -> MemoryPlan:
  params, grads, opt = trainer_state_bytes(model, layout)
  return MemoryPlan(f"trainer {layout}", hw.hbm_bytes * eff.usable_memory, params=params, grads=grads,
                    optimizer=opt, activations=trainer_activation_bytes(model, layout, work, remat))


def gen_weight_bytes(model: ModelShape, gen: GeneratorLayout) -> float:
  return model.params * gen.weight_bytes / gen.model_parallel


def kv_bytes_per_sequence(model: ModelShape, gen: GeneratorLayout, work: Workload) -> float:
  """bf16 KV of one full-length sequence per GPU: kv heads split over tp (replicated past kv_heads)."""
  return work.max_len * model.kv_bytes_per_token(2) / (min(gen.tp, model.kv_heads) * gen.pp)


def kv_slots(model: ModelShape, gen: GeneratorLayout, work: Workload, free_bytes: float) -> int:
  """Sequences a replica decodes at once: its share of the batch, capped by the KV memory left."""
  share = math.ceil(work.sequences / gen.replicas)
  return max(0, min(share, int(free_bytes // kv_bytes_per_sequence(model, gen, work))))


def generator_memory(model: ModelShape, gen: GeneratorLayout, work: Workload, hw: Hardware, eff: Efficiency,
                     resident: MemoryPlan | None = None) -> MemoryPlan:
  """Generator weights + the KV cache of the sequences it decodes at once.

  `resident`: trainer state that stays on the same GPUs while generating (colocated baseline).
  """
  budget = hw.hbm_bytes * eff.usable_memory
  kept = dict(params=resident.params, grads=resident.grads, optimizer=resident.optimizer) if resident else {}
  weights = gen_weight_bytes(model, gen)
  free = budget - weights - sum(kept.values())
  slots = kv_slots(model, gen, work, free)
  kv = max(slots, 1) * kv_bytes_per_sequence(model, gen, work)
  role = f"{'colocated ' if resident else ''}generator {gen}"
  return MemoryPlan(role, budget, gen_weights=weights, kv_cache=kv, **kept)


# ------------------------------------------------------------------------------------------------
# time


def train_seconds(model: ModelShape, layout: TrainerLayout, work: Workload, hw: Hardware, eff: Efficiency,
                  remat: bool = True) -> float:
  """One optimizer step over `work.train_tokens` packed tokens.

  compute at `eff.mfu`, divided by (1 - pipeline bubble); FSDP all-gathers / reduce-scatters overlap
  compute (the max of the two is paid); tensor-parallel all-reduces are exposed.
  """
  tokens = work.train_tokens
  context = (work.prompt_len + work.response_mean) / 2  # mean causal context of a token
  flops = ((6 + 2 * remat) * model.matmul_params + (3 + remat) * model.attention_flops_per_token(context)) * tokens
  compute = flops / (layout.gpus * hw.peak_flops * eff.mfu)
  mb = microbatch_tokens(layout, work)
  micro = math.ceil(tokens / (layout.dp * layout.fsdp) / mb)
  compute /= 1 - (layout.pp - 1) / (micro + layout.pp - 1)
  mp_across = layout.tp > hw.gpus_per_node
  tp_comm = micro * (model.layers / layout.pp) * (4 + 2 * remat) * collective_seconds(
      mb * model.hidden * 2, layout.tp, hw, eff, across_nodes=mp_across)
  fsdp_rounds = micro if layout.pp == 1 else 1  # ZeRO-3 re-gathers per microbatch; ZeRO-1 once
  shard_params = model.params / layout.model_parallel
  fsdp_bytes = fsdp_rounds * (2 * (2 + remat) + 4) * shard_params
  fsdp_comm = collective_seconds(fsdp_bytes, layout.fsdp, hw, eff, volume=1.0,
                                 across_nodes=layout.fsdp * layout.tp > hw.gpus_per_node)
  optimizer = 28 * model.params / (layout.fsdp * layout.model_parallel) / (hw.hbm_bandwidth * eff.hbm)
  return max(compute, fsdp_comm) + tp_comm + optimizer


def decode_step_seconds(model: ModelShape, gen: GeneratorLayout, batch: int, context: float, hw: Hardware,
                        eff: Efficiency) -> float:
  """One token for `batch` sequences of one replica whose mean context is `context` tokens.

  HBM-bound (weights + KV read once per step) or FLOP-bound, whichever is slower, plus two all-reduces
  of [batch, hidden] per layer over tp and one hop per pipeline stage. Pipeline stages of a replica
  run one after the other, so the step costs the sum over stages: pp does not shorten it.
  """
  weights = model.matmul_params * gen.weight_bytes / gen.tp
  kv = batch * context * model.kv_bytes_per_token(2) / min(gen.tp, model.kv_heads)
  t_mem = (weights + kv) / (hw.hbm_bandwidth * eff.hbm)
  peak = hw.peak_flops * (hw.fp8_speedup if gen.dtype == "fp8" else 1.0)
  flops = (2 * model.matmul_params + model.attention_flops_per_token(context)) * batch
  t_flop = flops / (gen.tp * peak * eff.mfu)
  act = batch * model.hidden * 2
  t_comm = 2 * model.layers * collective_seconds(act, gen.tp, hw, eff, across_nodes=gen.tp > hw.gpus_per_node)
  if gen.pp > 1:  # one send per stage boundary, across nodes when the replica spans nodes
    across = gen.model_parallel > hw.gpus_per_node
    hop, bandwidth = ((eff.network_latency, hw.network_bandwidth) if across else
                      (eff.nvlink_latency, hw.nvlink_bandwidth))
    t_comm += (gen.pp - 1) * (hop + act / (bandwidth * eff.link))
  return max(t_mem, t_flop) + t_comm + eff.decode_overhead


def generate_seconds(model: ModelShape, gen: GeneratorLayout, work: Workload, hw: Hardware, eff: Efficiency,
                     *, streaming: bool, slots: int) -> float:
  """Time to produce one step's `work.sequences` responses with `slots` sequences in flight per replica.

  streaming (async, continuous batching): a finished sequence's slot takes the next prompt at once, so
  a replica pays its share x `response_mean` tokens / slots steps. Static (sync): every wave of `slots`
  sequences runs `response_max` steps, bound by its longest response. Prefill is FLOP-bound.
  """
  if slots < 1:
    return math.inf
  share = math.ceil(work.sequences / gen.replicas)
  if streaming:
    steps, context = share * work.response_mean / slots, work.prompt_len + work.response_mean / 2
  else:
    steps, context = math.ceil(share / slots) * work.response_max, work.prompt_len + work.response_max / 2
  peak = hw.peak_flops * (hw.fp8_speedup if gen.dtype == "fp8" else 1.0)
  prefill = 2 * model.matmul_params * work.sequences * work.prompt_len / (gen.gpus * peak * eff.mfu) * gen.pp
  return prefill + steps * decode_step_seconds(model, gen, slots, context, hw, eff)


def weight_sync_seconds(model: ModelShape, trainer: TrainerLayout, gen: GeneratorLayout, hw: Hardware,
                        eff: Efficiency) -> float:
  """Trainer -> generator copy (DDMA): every generator GPU receives its shard of the cast weights,
  every trainer GPU sends its slice to each replica, all in parallel over the per-GPU network link."""
  nbytes = model.params * gen.weight_bytes
  per_gpu = max(nbytes / gen.model_parallel, nbytes * gen.replicas / trainer.gpus)
  return eff.network_latency + per_gpu / (hw.network_bandwidth * eff.link)


def reshard_seconds(model: ModelShape, gen: GeneratorLayout, hw: Hardware, eff: Efficiency) -> float:
  """Colocated: every GPU gathers its bf16 tp shard of the next weights from the FSDP shards, in place
  (the hybrid engine's switch from training to generation), over the network."""
  return eff.network_latency + model.params * 2 / gen.model_parallel / (hw.network_bandwidth * eff.link)



# ------------------------------------------------------------------------------------------------
# steps and layouts


@dataclass(frozen=True)
class StepPrediction:
  """Seconds per RL step and its parts, with the layouts and memory plans they assume."""

  mode: str  # "sync" (colocated, in sequence) or "async" (disjoint GPU sets, overlapped)
  total: float
  generate: float
  train: float
  weight_sync: float
  overhead: float
  trainer: TrainerLayout
  generator: GeneratorLayout
  memory: tuple[MemoryPlan, ...]

  @property
  def fits(self) -> bool:
    return all(m.fits for m in self.memory)


def sync_step(model: ModelShape, trainer: TrainerLayout, gen: GeneratorLayout, work: Workload,
              hw: Hardware = Hardware(), eff: Efficiency | None = None) -> StepPrediction:
  """The DeepSpeed-Chat-like baseline: both roles colocated on the same GPUs, in sequence.

  Generate (static batches bound by the longest response; the trainer's params, grads and Adam state
  stay resident, the KV cache gets what is left) -> train on all GPUs -> gather the next bf16 copy.
  """
  eff = eff or CALIBRATED
  if trainer.gpus != gen.gpus:
    raise ValueError(f"colocated roles share their GPUs: trainer {trainer} vs generator {gen}")
  train_mem = trainer_memory(model, trainer, work, hw, eff)
  gen_mem = generator_memory(model, gen, work, hw, eff, resident=train_mem)
  free = gen_mem.budget - gen_mem.gen_weights - gen_mem.params - gen_mem.grads - gen_mem.optimizer
  t_gen = generate_seconds(model, gen, work, hw, eff, streaming=False, slots=kv_slots(model, gen, work, free))
  t_train = train_seconds(model, trainer, work, hw, eff)
  t_sync = reshard_seconds(model, gen, hw, eff)
  total = eff.step_overhead + t_gen + t_train + t_sync
  return StepPrediction("sync", total, t_gen, t_train, t_sync, eff.step_overhead, trainer, gen, (train_mem, gen_mem))


def async_step(model: ModelShape, trainer: TrainerLayout, gen: GeneratorLayout, work: Workload,
               hw: Hardware = Hardware(), eff: Efficiency | None = None) -> StepPrediction:
  """LlamaRL: generator and trainer on disjoint GPUs at the same time (policy lag 1).

  Step = max(generate, train) + the weight sync (exposed: the generator waits for the new weights).
  """
  eff = eff or CALIBRATED
  train_mem = trainer_memory(model, trainer, work, hw, eff)
  gen_mem = generator_memory(model, gen, work, hw, eff)
  free = gen_mem.budget - gen_mem.gen_weights
  t_gen = generate_seconds(model, gen, work, hw, eff, streaming=True, slots=kv_slots(model, gen, work, free))
  t_train = train_seconds(model, trainer, work, hw, eff)
  t_sync = weight_sync_seconds(model, trainer, gen, hw, eff)
  total = eff.step_overhead + max(t_gen, t_train) + t_sync
  return StepPrediction("async", total, t_gen, t_train, t_sync, eff.step_overhead, trainer, gen, (train_mem, gen_mem))


def _powers_of_two(limit: int) -> list[int]:
  return [2**i for i in range(int(math.log2(limit)) + 1)]


def trainer_layouts(model: ModelShape, gpus: int, hw: Hardware = Hardware(), *, max_tp: int | None = None,
                    max_pp: int = 16) -> list[TrainerLayout]:
  """Candidate fsdp x tp x pp layouts over exactly `gpus` GPUs (tp <= max_tp, default one node)."""
  out = []
  for tp in _powers_of_two(max_tp or hw.gpus_per_node):
    for pp in _powers_of_two(max_pp):
      if gpus % (tp * pp) == 0 and pp <= model.layers:
        out.append(TrainerLayout(fsdp=gpus // (tp * pp), tp=tp, pp=pp))
  return out


def _best(preds):
  preds = [p for p in preds if p.fits and math.isfinite(p.total)]
  return min(preds, key=lambda p: p.total) if preds else None


def choose_sync_layout(model: ModelShape, gpus: int, work: Workload, hw: Hardware = Hardware(),
                       eff: Efficiency | None = None, max_gen_tp: int = 32) -> StepPrediction:
  """The DeepSpeed-Chat-like baseline's layout on all `gpus`: a ZeRO-3 (FSDP) trainer over every GPU,
  and a bf16 hybrid-engine generator whose tp (<= max_gen_tp, may span nodes) is the fastest that fits
  beside the resident trainer state. Raises ValueError when nothing fits."""
  eff = eff or CALIBRATED
  trainer = TrainerLayout(fsdp=gpus)
  best = _best(sync_step(model, trainer, GeneratorLayout(tp=tp, replicas=gpus // tp), work, hw, eff)
               for tp in _powers_of_two(max_gen_tp) if gpus % tp == 0)
  if best is None:
    raise ValueError(f"no colocated layout of {model.name} on {gpus} GPUs fits {hw.hbm_bytes / GB:.0f} GB "
                     "per GPU; use more GPUs or the asynchronous layout")
  return best


def choose_async_layout(model: ModelShape, gpus: int, work: Workload, hw: Hardware = Hardware(),
                        eff: Efficiency | None = None, quantize: str = "auto") -> StepPrediction:
  """Split `gpus` into generator and trainer (whole nodes each), and pick each side's layout, to
  minimise the async step with both memory plans fitting. Raises ValueError when nothing fits.

  quantize: "auto" decodes in fp8 only when the bf16 weights would take over 3/4 of a node's memory
  (LlamaRL's 405B generator); "fp8" / "bf16" force the generator dtype.
  """
  eff = eff or CALIBRATED
  node = hw.gpus_per_node
  if quantize == "auto":
    big = gen_weight_bytes(model, GeneratorLayout(tp=node)) > 0.75 * hw.hbm_bytes * eff.usable_memory
    quantize = "fp8" if big else "bf16"
  preds = []
  step = max(node, gpus // 16)  # generator share in sixteenths of the cluster (whole nodes)
  for gen_gpus in range(step, gpus, step):
    trainers = [t for t in trainer_layouts(model, gpus - gen_gpus, hw) if trainer_memory(model, t, work, hw, eff).fits]
    if not trainers:
      continue
    trainer = min(trainers, key=lambda t: train_seconds(model, t, work, hw, eff))
    preds += [async_step(model, trainer, GeneratorLayout(tp=tp, replicas=gen_gpus // tp, dtype=quantize), work, hw, eff)
              for tp in _powers_of_two(node) if gen_gpus % tp == 0]
  best = _best(preds)
  if best is None:
    raise ValueError(f"no asynchronous layout of {model.name} on {gpus} GPUs fits {hw.hbm_bytes / GB:.0f} GB per GPU")
  return best


CALIBRATED = Efficiency()
DEFAULT_WORKLOAD = Workload()

# (model, GPUs): (sync s, async s) from LlamaRL (arXiv 2505.24034), Llama 3 post-training on H100s.
PAPER = {("8b", 256): (22.45, 8.90), ("70b", 256): (82.32, 20.67), ("405b", 1024): (635.8, 59.5)}
