"""Step-time and memory model of LlamaRL-style RL post-training: a plan on paper, in code.

Pure Python (no JAX). Given a model shape (Llama 3, Qwen2.5, Qwen3), a GPU count, each executor's layout,
H100 numbers and a few achieved-efficiency factors, it predicts

  * the synchronous step of the paper's DeepSpeed-Chat-like baseline: trainer and generator colocated
    on all GPUs, generate -> train -> reshard in sequence;
  * the asynchronous step of LlamaRL: generator and trainer on disjoint GPU sets at the same time,
    max(generate, train) + the exposed weight sync;
  * the weight-sync time (DDMA): the generator's bf16 / fp8 copy sent trainer -> generator, every shard
    in parallel over its GPU's network link;
  * the per-GPU memory plan (params, grads, fp32 Adam, remat activations, generator weights, KV cache),
    and `choose_layout`, which picks the fastest layouts that fit.

What each phase costs (the docstrings of the functions below say the rest):

  train     (6 + 2 remat) x N x tokens FLOPs (+ attention) at `Efficiency.mfu` of the bf16 peak, over
            packed tokens (prompt + mean response; `Workload.packed`). ZeRO-3 / FSDP gathers the bf16 weights for the
            forward, the recompute and the backward and reduce-scatters fp32 grads, per microbatch; that
            traffic overlaps compute (the slower of the two is paid). Tensor-parallel all-reduces and
            the pipeline bubble are exposed.
  decode    a step emits one token per sequence in flight: read the weights and the KV cache at
            `Efficiency.hbm` of peak bandwidth (or FLOP-bound, whichever is slower), two ring
            all-reduces per layer over tp, plus `Efficiency.decode_overhead` (sampling, scheduling).
            A ring step across nodes costs `network_latency`: tensor parallelism that spans nodes pays
            it 2 (tp - 1) times per all-reduce, twice per layer, every token.
  generate  synchronous: static batches, each lasting its longest response (`response_max` steps),
            as many waves as the KV cache that is left allows. Asynchronous: continuous batching
            streams prompts into free slots, so a batch costs its mean length (`response_mean`).
  sync      every generator GPU receives params x bytes / tp, every trainer GPU sends its slice to each
            replica, over the 400 Gb/s per-GPU link at `Efficiency.link`.

The two systems compared, as in the paper:

  baseline  DeepSpeed-Chat-like: a ZeRO-3 trainer over all GPUs; a bf16 hybrid-engine generator whose
            tensor parallelism is the fastest that fits beside the trainer's resident params, grads and
            Adam state (at 405B that is 16 GPUs: two nodes, so every decode all-reduce crosses the
            network). Synchronous, static batches.
  LlamaRL   disjoint meshes: an FSDP x TP (x PP) trainer and fp8 generator replicas with tp inside a
            node, the split chosen to balance the two; lag-1 asynchronous, streaming generation.

Calibration: `CALIBRATED` is one set of constants for every model size, chosen by a coarse grid
search over plausible values so that the six step times LlamaRL published are all reproduced within
25% (`python -m llamarl_jax.measure.perf_model` prints the table; currently within 12%). The workload is an
assumption, not read from the paper (we could not get its experimental details): 128 prompts x 8
samples, 512 prompt tokens, responses of mean 1536 and max 4096 tokens (`PAPER_WORKLOAD`). What carries
the 405B baseline's 10x is mostly the cross-node tensor parallelism of its bf16 generator: with
`network_latency` at 10 us per ring step (pessimistic next to NCCL's tree all-reduce, plausible for a
training engine decoding without CUDA graphs) a two-node all-reduce costs 0.3 ms, 252 of them a token.

This repo's implementation is modelled with `--this_repo` (`quantize="bf16", max_pp=1,
streaming=True`, `Workload(packed=False)`): its trainer pads responses to `max_new_tokens`, its
generator is the slot engine (continuous batching over as many KV slots as the memory left holds:
`controller_bindings` sets `engine_slots`), and its meshes have no pipeline axis; its fp8 generator
(`GeneratorConfig.quantize='fp8'`) is modelled by `quantize="fp8"`.

Measured calibration: `python -m llamarl_jax.measure.perf_model --calibrate results.json` reads the JSON of
`make bench-gpu` (scripts/bench_gpu.py) and replaces the assumed efficiencies with the measured ones
(`calibrate`: training MFU, decode bandwidth efficiency and per-step overhead, weight-push link
efficiency when it crossed devices), then predicts the paper's configurations with them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass

GB = 1e9


# ------------------------------------------------------------------------------------------------
# inputs


@dataclass(frozen=True)
class ModelShape:
  """A dense decoder: Llama 3 (untied embeddings, GQA) by default; Qwen2 / Qwen3 set the rest.

  head_dim: 0 means hidden / heads (Llama, Qwen2); Qwen3 states its own (128). tied: one embedding table
  that is also the output projection. qkv_bias (Qwen2) and qk_norm (Qwen3) add a few parameters.
  """

  name: str
  layers: int
  hidden: int
  heads: int
  kv_heads: int
  intermediate: int
  vocab: int = 128256
  head_dim: int = 0
  tied: bool = False
  qkv_bias: bool = False
  qk_norm: bool = False

  def __post_init__(self):
    if not self.head_dim:
      object.__setattr__(self, "head_dim", self.hidden // self.heads)

  @property
  def layer_params(self) -> int:
    d, hd = self.hidden, self.head_dim
    qkv = hd * (self.heads + 2 * self.kv_heads)
    attn = d * qkv + self.heads * hd * d + self.qkv_bias * qkv + self.qk_norm * 2 * hd
    return attn + 3 * d * self.intermediate + 2 * d

  @property
  def params(self) -> int:
    return self.layers * self.layer_params + (1 if self.tied else 2) * self.vocab * self.hidden + self.hidden

  @property
  def matmul_params(self) -> int:
    """Parameters a token multiplies with: all but the input embedding (a gather), unless it is tied
    to the output projection (which is a matmul)."""
    return self.params - (0 if self.tied else self.vocab * self.hidden)

  def kv_bytes_per_token(self, nbytes: int = 2) -> int:
    """K and V of one token, every layer and kv head."""
    return 2 * self.layers * self.kv_heads * self.head_dim * nbytes

  def attention_flops_per_token(self, context: float) -> float:
    """Forward FLOPs of q.k and p.v for one token attending to `context` tokens."""
    return 4 * self.layers * self.heads * self.head_dim * context


LLAMA3 = {
    "8b": ModelShape("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336),
    "70b": ModelShape("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, intermediate=28672),
    "405b": ModelShape("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, intermediate=53248),
}
# Shapes from the released config.json files (Qwen2.5-1.5B(-Instruct), Qwen2.5-7B, Qwen3-1.7B, Qwen3-8B).
QWEN = {
    "qwen2.5-1.5b": ModelShape("qwen2.5-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960,
                               vocab=151936, tied=True, qkv_bias=True),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944,
                             vocab=152064, qkv_bias=True),
    "qwen3-1.7b": ModelShape("qwen3-1.7b", layers=28, hidden=2048, heads=16, kv_heads=8, intermediate=6144,
                             vocab=151936, head_dim=128, tied=True, qk_norm=True),
    "qwen3-8b": ModelShape("qwen3-8b", layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288,
                           vocab=151936, head_dim=128, qk_norm=True),
}
MODELS = {**LLAMA3, **QWEN}  # what `--size` and `choose_layout(model="...")` accept


@dataclass(frozen=True)
class Hardware:
  """H100 SXM 80 GB nodes: 8 GPUs on NVLink 4 per node, one 400 Gb/s InfiniBand NIC per GPU."""

  peak_flops: float = 989e12  # dense bf16
  fp8_speedup: float = 2.0  # dense fp8 peak / bf16 peak
  hbm_bandwidth: float = 3.35e12
  hbm_bytes: float = 80 * GB
  nvlink_bandwidth: float = 450 * GB  # per GPU, one direction (900 GB/s both ways)
  network_bandwidth: float = 50 * GB  # per GPU, one direction
  gpus_per_node: int = 8


@dataclass(frozen=True)
class Efficiency:
  """Achieved fractions of peak and fixed latencies: the calibration, one set for every model size.

  Chosen by a coarse grid search over plausible values against the paper's six step times (with
  `PAPER_WORKLOAD`). `mfu` counts the remat recompute (without it, 0.5 is 0.375 of model FLOPs).
  """

  mfu: float = 0.50  # training (and FLOP-bound decode): FLOPs incl. the remat recompute / (GPUs x peak)
  hbm: float = 0.60  # decode: achieved / peak HBM bandwidth
  link: float = 0.75  # achieved / peak NVLink or network bandwidth
  nvlink_latency: float = 1.5e-6  # one ring step between GPUs of a node (s)
  network_latency: float = 10e-6  # one ring step between nodes (s)
  step_overhead: float = 3.0  # per RL step: reward scoring, orchestration, host work (s)
  decode_overhead: float = 1e-3  # per decode step: sampling, scheduling, launches (s)
  usable_memory: float = 0.90  # of HBM; the rest is CUDA context, NCCL buffers, fragmentation


CALIBRATED = Efficiency()

# Llama 3.2 1B (tied embeddings): the size scripts/bench_gpu.py measures on one GPU
LLAMA32_1B = ModelShape("llama3.2-1b", layers=16, hidden=2048, heads=32, kv_heads=8, intermediate=8192, tied=True)


@dataclass(frozen=True)
class Workload:
  """One RL step: `prompts x samples` sequences of `prompt_len` prompt tokens and a response each."""

  prompts: int = 128
  samples: int = 8
  prompt_len: int = 512
  response_mean: int = 1536
  response_max: int = 4096
  microbatch_tokens: int = 16384  # per trainer data-parallel rank and microbatch
  packed: bool = True  # the trainer packs rows; False: pads each to prompt_len + response_max (this repo)

  @property
  def sequences(self) -> int:
    return self.prompts * self.samples

  @property
  def train_tokens(self) -> int:
    """Tokens the trainer processes per step: prompt + response per row, packed or padded to the max."""
    return self.sequences * (self.prompt_len + (self.response_mean if self.packed else self.response_max))

  @property
  def max_len(self) -> int:
    return self.prompt_len + self.response_max


PAPER_WORKLOAD = Workload()

# (model, GPUs): (sync s, async s) published by LlamaRL (arXiv 2505.24034, Llama 3 post-training, H100).
PAPER = {("8b", 256): (22.45, 8.90), ("70b", 256): (82.32, 20.67), ("405b", 1024): (635.8, 59.5)}
PAPER_MAX_SYNC_SECONDS = 2.0  # "weight sync under 2 s" at 405B


@dataclass(frozen=True)
class TrainerLayout:
  """dp x fsdp x tp x pp GPUs: tp innermost (inside a node), then pp, then fsdp (ZeRO-3 shards)."""

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
    axes = [f"fsdp{self.fsdp}", f"tp{self.tp}"] + [f"pp{self.pp}"] * (self.pp > 1) + [f"dp{self.dp}"] * (self.dp > 1)
    return "x".join(axes) + f" ({self.gpus} GPUs)"


@dataclass(frozen=True)
class GeneratorLayout:
  """`replicas` independent decoders of tp x pp GPUs each, weights in `dtype` ("bf16" or "fp8")."""

  tp: int = 1
  replicas: int = 1
  pp: int = 1
  dtype: str = "bf16"

  def __post_init__(self):
    if self.dtype not in ("bf16", "fp8"):
      raise ValueError(f"generator dtype must be 'bf16' or 'fp8', got {self.dtype!r}")

  @property
  def gpus(self) -> int:
    return self.replicas * self.tp * self.pp

  @property
  def model_parallel(self) -> int:
    return self.tp * self.pp

  @property
  def weight_bytes(self) -> int:
    return 2 if self.dtype == "bf16" else 1

  def __str__(self) -> str:
    mp = f"tp{self.tp}" + (f"xpp{self.pp}" if self.pp > 1 else "")
    return f"{mp} x {self.replicas} replicas {self.dtype} ({self.gpus} GPUs)"


# ------------------------------------------------------------------------------------------------
# communication


def collective_seconds(nbytes: float, group: int, hw: Hardware, eff: Efficiency, *, across_nodes: bool,
                       volume: float = 2.0) -> float:
  """A ring collective over `group` GPUs: volume x (g - 1) steps, each a hop latency plus 1/g of the bytes.

  volume 2: all-reduce; 1: all-gather or reduce-scatter. A ring spanning nodes steps at its network pace.
  """
  if group <= 1:
    return 0.0
  bandwidth = (hw.network_bandwidth if across_nodes else hw.nvlink_bandwidth) * eff.link
  hop = eff.network_latency if across_nodes else eff.nvlink_latency
  return volume * (group - 1) * (hop + nbytes / group / bandwidth)


# ------------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class MemoryPlan:
  """Bytes per GPU by kind, against the usable HBM budget."""

  role: str
  budget: float
  params: float = 0.0  # trainer weights that live across steps
  grads: float = 0.0
  optimizer: float = 0.0  # fp32 Adam (m, v), + fp32 master weights under ZeRO-1
  activations: float = 0.0  # remat checkpoints, one recomputed layer, logits, FSDP-gathered layers
  gen_weights: float = 0.0  # the generator's bf16 / fp8 copy
  kv_cache: float = 0.0

  @property
  def total(self) -> float:
    return self.params + self.grads + self.optimizer + self.activations + self.gen_weights + self.kv_cache

  @property
  def fits(self) -> bool:
    return self.total <= self.budget

  def parts(self) -> str:
    kinds = ("params", "grads", "optimizer", "activations", "gen_weights", "kv_cache")
    return " ".join(f"{k}={getattr(self, k) / GB:.1f}" for k in kinds if getattr(self, k))

  def check(self) -> "MemoryPlan":
    """Return self if it fits; otherwise raise ValueError saying by how much and what to change."""
    if not self.fits:
      raise ValueError(f"{self.role} needs {self.total / GB:.1f} GB per GPU but {self.budget / GB:.1f} GB are "
                       f"usable ({self.parts()} GB): shard over more GPUs (fsdp / tp), keep remat on, or "
                       "shorten microbatches / responses")
    return self

  def __str__(self) -> str:
    verdict = "fits" if self.fits else "DOES NOT FIT"
    return f"{self.role}: {self.parts()} -> {self.total / GB:.1f} / {self.budget / GB:.0f} GB, {verdict}"


def trainer_state_bytes(model: ModelShape, layout: TrainerLayout) -> tuple[float, float, float]:
  """(params, grads, optimizer) bytes per GPU that live across steps.

  pp == 1, ZeRO-3 / FSDP: fp32 weights, fp32 grads, fp32 Adam m and v, all sharded over fsdp x tp
  (16 bytes / param / GPU). pp > 1, ZeRO-1 inside each stage (Megatron style): the stage's bf16 weights
  and fp32 grads resident, fp32 master weights + Adam sharded over fsdp.
  """
  n, mp = model.params, layout.model_parallel
  shard = layout.fsdp * mp
  if layout.pp == 1:
    return 4 * n / shard, 4 * n / shard, 8 * n / shard
  return 2 * n / mp, 4 * n / mp, 12 * n / shard


def microbatch_tokens(layout: TrainerLayout, work: Workload) -> int:
  """Tokens of one microbatch on one data-parallel rank: `work.microbatch_tokens`, or all its tokens."""
  return max(1, min(work.microbatch_tokens, math.ceil(work.train_tokens / (layout.dp * layout.fsdp))))


def trainer_activation_bytes(model: ModelShape, layout: TrainerLayout, work: Workload, remat: bool = True) -> float:
  """Transient training memory per GPU for one microbatch (sequence parallel over tp).

  remat: each layer's input ([tokens, hidden] bf16) is kept, plus one layer's recomputed internals
  (~10 hidden + 4 intermediate wide, flash attention) and fp32 logits and their gradient; without
  remat every layer keeps its internals. With pp, 1F1B keeps pp microbatches of layers / pp layers in
  flight: the same layers' worth. FSDP adds the bf16 copies of the two layers being gathered.
  """
  t, d, f = microbatch_tokens(layout, work), model.hidden, model.intermediate
  internals = t * (10 * d + 4 * f) * 2
  kept = model.layers * t * d * 2 + internals if remat else model.layers * internals
  logits = 2 * t * model.vocab * 4
  gathered = 2 * 2 * model.layer_params if layout.fsdp > 1 and layout.pp == 1 else 0
  return (kept + logits + gathered) / layout.tp


def trainer_memory(model: ModelShape, layout: TrainerLayout, work: Workload, hw: Hardware = Hardware(),
                   eff: Efficiency = CALIBRATED, remat: bool = True) -> MemoryPlan:
  params, grads, opt = trainer_state_bytes(model, layout)
  return MemoryPlan(f"trainer {layout}", hw.hbm_bytes * eff.usable_memory, params=params, grads=grads,
                    optimizer=opt, activations=trainer_activation_bytes(model, layout, work, remat))


def gen_weight_bytes(model: ModelShape, gen: GeneratorLayout) -> float:
  return model.params * gen.weight_bytes / gen.model_parallel


def kv_bytes_per_sequence(model: ModelShape, gen: GeneratorLayout, work: Workload) -> float:
  """bf16 KV cache of one full-length sequence per GPU: kv heads split over tp (replicated past kv_heads)."""
  return work.max_len * model.kv_bytes_per_token(2) / (min(gen.tp, model.kv_heads) * gen.pp)


def kv_slots(model: ModelShape, gen: GeneratorLayout, work: Workload, free_bytes: float) -> int:
  """Sequences a replica decodes at once: its share of the batch, capped by the KV memory left."""
  share = math.ceil(work.sequences / gen.replicas)
  return max(0, min(share, int(free_bytes // kv_bytes_per_sequence(model, gen, work))))


def generator_memory(model: ModelShape, gen: GeneratorLayout, work: Workload, hw: Hardware = Hardware(),
                     eff: Efficiency = CALIBRATED, resident: MemoryPlan | None = None,
                     whole_share: bool = False) -> MemoryPlan:
  """Generator weights + the KV cache of the sequences it decodes at once (at least one).

  `resident`: a colocated trainer's plan; its params, grads and optimizer state stay on the GPUs while
  generating (its activations are freed), and the KV cache gets what is left. `whole_share`: the
  replica decodes its whole share of the batch at once (a static sampler, e.g. this repo's
  `generator_engine='static'`), fitting or not.
  """
  budget = hw.hbm_bytes * eff.usable_memory
  kept = dict(params=resident.params, grads=resident.grads, optimizer=resident.optimizer) if resident else {}
  weights = gen_weight_bytes(model, gen)
  slots = (math.ceil(work.sequences / gen.replicas) if whole_share else
           kv_slots(model, gen, work, budget - weights - sum(kept.values())))
  kv = max(slots, 1) * kv_bytes_per_sequence(model, gen, work)
  role = ("colocated " if resident else "") + f"generator {gen}"
  return MemoryPlan(role, budget, gen_weights=weights, kv_cache=kv, **kept)


# ------------------------------------------------------------------------------------------------
# time


def train_seconds(model: ModelShape, layout: TrainerLayout, work: Workload, hw: Hardware = Hardware(),
                  eff: Efficiency = CALIBRATED, remat: bool = True) -> float:
  """One optimizer step over `work.train_tokens` tokens.

  max(compute / (1 - bubble), FSDP traffic) + tensor-parallel all-reduces + the gradient all-reduce over
  dp replicas + the Adam update (HBM-bound). ZeRO-3 re-gathers the weights every microbatch; ZeRO-1
  (pp > 1) once per step.
  """
  tokens = work.train_tokens
  context = work.train_tokens / work.sequences / 2  # mean causal context of a token
  flops = ((6 + 2 * remat) * model.matmul_params + (3 + remat) * model.attention_flops_per_token(context)) * tokens
  compute = flops / (layout.gpus * hw.peak_flops * eff.mfu)
  mb = microbatch_tokens(layout, work)
  micro = math.ceil(tokens / (layout.dp * layout.fsdp) / mb)
  compute /= 1 - (layout.pp - 1) / (micro + layout.pp - 1)
  tp_comm = micro * (model.layers / layout.pp) * (4 + 2 * remat) * collective_seconds(
      mb * model.hidden * 2, layout.tp, hw, eff, across_nodes=layout.tp > hw.gpus_per_node)
  rounds = micro if layout.pp == 1 else 1
  fsdp_bytes = rounds * (2 * (2 + remat) + 4) * model.params / layout.model_parallel
  fsdp_comm = collective_seconds(fsdp_bytes, layout.fsdp, hw, eff, volume=1.0,
                                 across_nodes=layout.fsdp * layout.model_parallel > hw.gpus_per_node)
  shard = layout.fsdp * layout.model_parallel
  dp_comm = collective_seconds(4 * model.params / shard, layout.dp, hw, eff, across_nodes=True)  # fp32 grads
  adam = 28 * model.params / shard / (hw.hbm_bandwidth * eff.hbm)
  return max(compute, fsdp_comm) + tp_comm + dp_comm + adam


def decode_step_seconds(model: ModelShape, gen: GeneratorLayout, batch: int, context: float,
                        hw: Hardware = Hardware(), eff: Efficiency = CALIBRATED) -> float:
  """One token for each of `batch` sequences of one replica, whose mean context is `context` tokens.

  max(HBM: weights + KV read once, FLOPs) + two all-reduces of [batch, hidden] per layer over tp + a
  send per pipeline stage + `eff.decode_overhead`. Stages of a replica run one after the other for a
  token, so pp never shortens a step.
  """
  weights = model.matmul_params * gen.weight_bytes / gen.tp
  kv = batch * context * model.kv_bytes_per_token(2) / min(gen.tp, model.kv_heads)
  t_mem = (weights + kv) / (hw.hbm_bandwidth * eff.hbm)
  peak = hw.peak_flops * (hw.fp8_speedup if gen.dtype == "fp8" else 1.0)
  t_flop = (2 * model.matmul_params + model.attention_flops_per_token(context)) * batch / (gen.tp * peak * eff.mfu)
  act = batch * model.hidden * 2
  t_comm = 2 * model.layers * collective_seconds(act, gen.tp, hw, eff, across_nodes=gen.tp > hw.gpus_per_node)
  if gen.pp > 1:
    across = gen.model_parallel > hw.gpus_per_node
    hop, bandwidth = ((eff.network_latency, hw.network_bandwidth) if across else
                      (eff.nvlink_latency, hw.nvlink_bandwidth))
    t_comm += (gen.pp - 1) * (hop + act / (bandwidth * eff.link))
  return max(t_mem, t_flop) + t_comm + eff.decode_overhead


def generate_seconds(model: ModelShape, gen: GeneratorLayout, work: Workload, hw: Hardware = Hardware(),
                     eff: Efficiency = CALIBRATED, *, streaming: bool, slots: int) -> float:
  """Time to produce one step's `work.sequences` responses with `slots` sequences in flight per replica.

  streaming (continuous batching): a finished sequence's slot takes the next prompt, so a replica runs
  share x `response_mean` / slots decode steps. Static: each wave of `slots` sequences runs
  `response_max` steps (its longest response). Plus a FLOP-bound prefill. inf when no slot fits.
  """
  if slots < 1:
    return math.inf
  share = math.ceil(work.sequences / gen.replicas)
  if streaming:
    steps, context = share * work.response_mean / slots, work.prompt_len + work.response_mean / 2
  else:
    steps, context = math.ceil(share / slots) * work.response_max, work.prompt_len + work.response_max / 2
  peak = hw.peak_flops * (hw.fp8_speedup if gen.dtype == "fp8" else 1.0)
  prefill = 2 * model.matmul_params * work.sequences * work.prompt_len * gen.pp / (gen.gpus * peak * eff.mfu)
  return prefill + steps * decode_step_seconds(model, gen, slots, context, hw, eff)


def weight_sync_seconds(model: ModelShape, trainer: TrainerLayout, gen: GeneratorLayout,
                        hw: Hardware = Hardware(), eff: Efficiency = CALIBRATED) -> float:
  """Trainer -> generator (DDMA): each generator GPU receives its tp shard of the cast weights and each
  trainer GPU sends its slice to every replica, all at once over the per-GPU network link."""
  nbytes = model.params * gen.weight_bytes
  per_gpu = max(nbytes / gen.model_parallel, nbytes * gen.replicas / trainer.gpus)
  return eff.network_latency + per_gpu / (hw.network_bandwidth * eff.link)


def reshard_seconds(model: ModelShape, gen: GeneratorLayout, hw: Hardware = Hardware(),
                    eff: Efficiency = CALIBRATED) -> float:
  """Colocated: each GPU gathers its bf16 tp shard of the new weights from the ZeRO-3 shards (the
  hybrid engine's switch from training to generation), over the network."""
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
              hw: Hardware = Hardware(), eff: Efficiency = CALIBRATED) -> StepPrediction:
  """The colocated synchronous step: generate (static batches, trainer state resident) -> train on all
  GPUs -> reshard the new weights into the generator's layout."""
  if trainer.gpus != gen.gpus:
    raise ValueError(f"colocated roles share their GPUs, but the trainer has {trainer} and the generator {gen}")
  train_mem = trainer_memory(model, trainer, work, hw, eff)
  gen_mem = generator_memory(model, gen, work, hw, eff, resident=train_mem)
  free = gen_mem.budget - gen_mem.gen_weights - gen_mem.params - gen_mem.grads - gen_mem.optimizer
  t_gen = generate_seconds(model, gen, work, hw, eff, streaming=False, slots=kv_slots(model, gen, work, free))
  t_train = train_seconds(model, trainer, work, hw, eff)
  t_sync = reshard_seconds(model, gen, hw, eff)
  total = eff.step_overhead + t_gen + t_train + t_sync
  return StepPrediction("sync", total, t_gen, t_train, t_sync, eff.step_overhead, trainer, gen, (train_mem, gen_mem))


def async_step(model: ModelShape, trainer: TrainerLayout, gen: GeneratorLayout, work: Workload,
               hw: Hardware = Hardware(), eff: Efficiency = CALIBRATED, streaming: bool = True) -> StepPrediction:
  """LlamaRL with policy lag 1: generator and trainer on disjoint GPUs at the same time; the step is
  max(generate, train) + the weight sync (exposed: the generator waits for the new weights).

  streaming=False models a static sampler instead (this repo's `generator_engine='static'`): each
  replica decodes its whole share as one static batch (bound by the longest response), so the whole
  share's KV cache must fit. This repo's default slot engine streams (streaming=True).
  """
  train_mem = trainer_memory(model, trainer, work, hw, eff)
  gen_mem = generator_memory(model, gen, work, hw, eff, whole_share=not streaming)
  free = gen_mem.budget - gen_mem.gen_weights
  slots = kv_slots(model, gen, work, free)
  t_gen = generate_seconds(model, gen, work, hw, eff, streaming=streaming, slots=slots)
  t_train = train_seconds(model, trainer, work, hw, eff)
  t_sync = weight_sync_seconds(model, trainer, gen, hw, eff)
  total = eff.step_overhead + max(t_gen, t_train) + t_sync
  return StepPrediction("async", total, t_gen, t_train, t_sync, eff.step_overhead, trainer, gen, (train_mem, gen_mem))


def _powers_of_two(limit: int) -> list[int]:
  return [2**i for i in range(int(math.log2(limit)) + 1)]


def trainer_layouts(model: ModelShape, gpus: int, work: Workload, hw: Hardware = Hardware(), *,
                    max_tp: int | None = None, max_pp: int = 16) -> list[TrainerLayout]:
  """fsdp x tp x pp layouts over exactly `gpus` GPUs: tp <= max_tp (default: one node), pp <= max_pp,
  and the step's sequences split evenly over the fsdp ranks."""
  out = []
  for tp in _powers_of_two(max_tp or hw.gpus_per_node):
    for pp in _powers_of_two(max_pp):
      fsdp = gpus // (tp * pp)
      if gpus % (tp * pp) == 0 and pp <= model.layers and work.sequences % fsdp == 0:
        out.append(TrainerLayout(fsdp=fsdp, tp=tp, pp=pp))
  return out


def _fastest(preds) -> StepPrediction | None:
  preds = [p for p in preds if p.fits and math.isfinite(p.total)]
  return min(preds, key=lambda p: p.total) if preds else None


def _no_fit(model: ModelShape, gpus: int, work: Workload, hw: Hardware, what: str) -> ValueError:
  return ValueError(f"no {what} layout of {model.name} on {gpus} GPUs fits {hw.hbm_bytes / GB:.0f} GB per GPU "
                    f"({work.sequences} sequences of up to {work.max_len} tokens); use more GPUs or a smaller "
                    "batch / response_max")


def choose_sync_layout(model: ModelShape, gpus: int, work: Workload = PAPER_WORKLOAD, hw: Hardware = Hardware(),
                       eff: Efficiency = CALIBRATED, max_gen_tp: int = 32) -> StepPrediction:
  """The DeepSpeed-Chat-like baseline on all `gpus`: a ZeRO-3 trainer over every GPU and the fastest
  bf16 hybrid-engine generator (tp <= max_gen_tp, may span nodes) that fits beside its state."""
  if work.sequences % gpus:
    raise ValueError(f"the ZeRO-3 baseline splits the step's {work.sequences} sequences over {gpus} GPUs: "
                     "make the batch a multiple of the GPU count")
  trainer = TrainerLayout(fsdp=gpus)
  best = _fastest(sync_step(model, trainer, GeneratorLayout(tp=tp, replicas=gpus // tp), work, hw, eff)
                  for tp in _powers_of_two(max_gen_tp) if gpus % tp == 0)
  if best is None:
    raise _no_fit(model, gpus, work, hw, "colocated")
  return best


def choose_async_layout(model: ModelShape, gpus: int, work: Workload = PAPER_WORKLOAD, hw: Hardware = Hardware(),
                        eff: Efficiency = CALIBRATED, quantize: str = "fp8", max_pp: int = 16,
                        streaming: bool = True) -> StepPrediction:
  """LlamaRL's split of `gpus`: the generator gets sixteenths of the cluster (any count under 16 GPUs)
  as tp x replicas, tp inside a node (16 GPUs when bf16 weights need it); the trainer the rest, as its
  fastest fitting fsdp x tp x pp. Returns the fastest async step whose memory plans fit.

  quantize: the generator's weights, "fp8" (LlamaRL's quantised generator) or "bf16". streaming: see
  `async_step` (False for a static-batch sampler; this repo's slot engine streams).
  """
  node = hw.gpus_per_node
  tps = _powers_of_two(node) + ([2 * node] if quantize == "bf16" else [])
  preds = []
  step = max(1, gpus // 16)
  for gen_gpus in range(step, gpus, step):
    trainers = [t for t in trainer_layouts(model, gpus - gen_gpus, work, hw, max_pp=max_pp)
                if trainer_memory(model, t, work, hw, eff).fits]
    if not trainers:
      continue
    trainer = min(trainers, key=lambda t: train_seconds(model, t, work, hw, eff))
    preds += [async_step(model, trainer, GeneratorLayout(tp=tp, replicas=gen_gpus // tp, dtype=quantize),
                         work, hw, eff, streaming) for tp in tps if gen_gpus % tp == 0]
  best = _fastest(preds)
  if best is None:
    raise _no_fit(model, gpus, work, hw, "asynchronous")
  return best


def choose_layout(model: ModelShape | str, gpus: int, work: Workload = PAPER_WORKLOAD, *, mode: str = "async",
                  hw: Hardware = Hardware(), eff: Efficiency = CALIBRATED, **kwargs) -> StepPrediction:
  """The fastest layouts that fit for `model` (a ModelShape or a key of `MODELS`) on `gpus` GPUs.

  mode "async": LlamaRL's disjoint trainer / generator (`choose_async_layout`, kwargs quantize, max_pp);
  "sync": the colocated baseline (`choose_sync_layout`). Raises ValueError when nothing fits.
  """
  model = MODELS[model.lower()] if isinstance(model, str) else model
  if mode == "async":
    return choose_async_layout(model, gpus, work, hw, eff, **kwargs)
  if mode == "sync":
    return choose_sync_layout(model, gpus, work, hw, eff, **kwargs)
  raise ValueError(f"mode must be 'async' or 'sync', got {mode!r}")


def controller_bindings(model: ModelShape, pred: StepPrediction, work: Workload, hw: Hardware = Hardware(),
                        eff: Efficiency = CALIBRATED) -> dict:
  """`llamarl_jax.controller.Controller` arguments realising an async prediction in this repo.

  The repo's meshes are fsdp x tp (no pp); its slot engine streams each replica's share through as
  many KV slots as fit beside the weights (`engine_slots` over all replicas, set when fewer than all rows
  fit: the Controller's default gives every row a slot); its trainer pads every row
  to prompt + `response_max` tokens, so `microbatches` keeps a rank's microbatch within
  `work.microbatch_tokens` padded tokens. Raises ValueError for layouts it cannot run.
  """
  if pred.trainer.pp > 1 or pred.trainer.dp > 1 or pred.generator.pp > 1:
    raise ValueError(f"this repo's meshes are fsdp x tp only; got trainer {pred.trainer}, generator "
                     f"{pred.generator} (choose with max_pp=1, or --this_repo)")
  gen_mem = generator_memory(model, pred.generator, work, hw, eff).check()
  slots = kv_slots(model, pred.generator, work, gen_mem.budget - gen_mem.gen_weights)
  if slots < 1:
    raise ValueError(f"generator {pred.generator}: no KV slot of {work.max_len} tokens fits beside the weights")
  rows = work.sequences // pred.trainer.fsdp  # per trainer rank
  per_micro = max([d for d in range(1, rows + 1) if rows % d == 0 and d * work.max_len <= work.microbatch_tokens]
                  or [1])
  out = dict(trainer_fsdp=pred.trainer.fsdp, trainer_tp=pred.trainer.tp, generator_dp=pred.generator.replicas,
             generator_tp=pred.generator.tp, microbatches=rows // per_micro, prompts_per_step=work.prompts,
             samples_per_prompt=work.samples, max_new_tokens=work.response_max)
  if slots < math.ceil(work.sequences / pred.generator.replicas):  # the default (0) gives every row a slot
    out["engine_slots"] = slots * pred.generator.replicas
  return out


# ------------------------------------------------------------------------------------------------
# calibration from measurements


def shape_from_json(d: dict) -> ModelShape:
  """A ModelShape from the `shape` dict bench_gpu records with each measurement."""
  fields = {f.name for f in dataclasses.fields(ModelShape)}
  return ModelShape(**{k: v for k, v in d.items() if k in fields})


def _trainer_mfu(tr: dict, hw: Hardware, eff: Efficiency, devices: int) -> float:
  """The `Efficiency.mfu` at which `train_seconds` reproduces the measured step `tr["step_s"]`.

  train_seconds = C / mfu + A on one FSDP group (C: the FLOPs, remat recompute included; A: the Adam
  update and other terms independent of mfu), so two evaluations give C and A, and mfu = C / (step - A).
  """
  model = shape_from_json(tr["shape"])
  rows = tr["B"]
  work = Workload(prompts=rows, samples=1, prompt_len=tr["P"], response_mean=tr["R"], response_max=tr["R"],
                  microbatch_tokens=-(-rows // devices) * (tr["P"] + tr["R"]) // max(tr.get("mb", 1), 1))
  layout = TrainerLayout(fsdp=devices)
  remat = bool(tr.get("remat", True))
  at = lambda m: train_seconds(model, layout, work, hw, dataclasses.replace(eff, mfu=m), remat=remat)
  c = at(0.5) - at(1.0)
  a = at(1.0) - c
  if tr["step_s"] <= a:
    raise ValueError(f"measured train step {tr['step_s']:.3f} s is below the model's floor {a:.3f} s")
  return c / (tr["step_s"] - a)


def _decode_fit(dec: dict, hw: Hardware) -> tuple[float, float]:
  """(hbm efficiency, per-step overhead s) from decode steps at several batch sizes: the least-squares
  line step = bytes / (peak bandwidth x hbm) + overhead, with bytes = bf16 weights + the mean valid KV
  cache as `decode_step_seconds` counts them (one replica, tp 1)."""
  model = shape_from_json(dec["shape"])
  context = dec["prompt_len"] + dec["new_tokens"] / 2
  pts = [(model.matmul_params * 2 + r["batch"] * context * model.kv_bytes_per_token(2), r["step_ms"] / 1e3)
         for r in dec["rows"]]
  if len(pts) < 2:
    raise ValueError("the decode fit needs steps at two batch sizes at least")
  mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
  slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
  overhead = my - slope * mx
  if slope <= 0 or overhead < 0:  # noisy or flat: all the time is bandwidth, no fixed part
    slope, overhead = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts), 0.0
  return min(1.0, 1 / (slope * hw.hbm_bandwidth)), overhead


def calibrate(results: dict, base: Efficiency = CALIBRATED) -> tuple[Efficiency, Hardware, list[str]]:
  """`base` with the efficiencies a `bench_gpu` JSON measured; the measured device's peaks; one note per
  value saying where it came from (or why it kept the assumed value).

  mfu (counts the remat recompute, as `Efficiency.mfu` does): fitted so `train_seconds` gives the
  measured trainer step. hbm and decode_overhead: `_decode_fit`. link: the weight push's bytes/s over
  the NVLink peak when it crossed devices (one GPU pushes in place: nothing crosses, link is kept).
  """
  sections, env = results.get("sections"), results.get("environment") or {}
  if not isinstance(sections, dict) or not sections:
    raise ValueError("not a bench_gpu result: no 'sections' (write one with `make bench-gpu`)")
  if env.get("dry_run"):
    raise ValueError("this is a --dry_run (toy sizes, maybe on CPU): it does not calibrate a GPU model; "
                     "run `make bench-gpu` on the GPU")
  hw = Hardware(peak_flops=env.get("peak_flops") or Hardware.peak_flops,
                hbm_bandwidth=env.get("peak_bandwidth") or Hardware.hbm_bandwidth)
  eff, notes = base, []
  dec = sections.get("decode") or {}
  if dec.get("rows") and "shape" in dec:
    hbm, overhead = _decode_fit(dec, hw)
    eff = dataclasses.replace(eff, hbm=hbm, decode_overhead=overhead)
    notes.append(f"hbm {base.hbm:.2f} -> {hbm:.3f}, decode_overhead {base.decode_overhead * 1e3:.2f} -> "
                 f"{overhead * 1e3:.3f} ms: decode of {dec['shape'].get('name', '?')} at batches "
                 f"{[r['batch'] for r in dec['rows']]}")
  else:
    notes.append(f"hbm {base.hbm:.2f}, decode_overhead {base.decode_overhead * 1e3:.2f} ms kept: no decode section")
  tr = sections.get("trainer") or {}
  if "step_s" in tr and "shape" in tr:
    mfu = _trainer_mfu(tr, hw, eff, int(env.get("device_count", 1)))
    eff = dataclasses.replace(eff, mfu=mfu)
    notes.append(f"mfu {base.mfu:.2f} -> {mfu:.3f} (remat recompute counted; the bench's model-FLOPs MFU was "
                 f"{tr['mfu']:.1%}): trainer {tr['B']} x ({tr['P']}+{tr['R']}), {tr['step_s'] * 1e3:.0f} ms/step")
  else:
    notes.append(f"mfu {base.mfu:.2f} kept: no trainer section")
  push = sections.get("weight_push") or {}
  if "push_gbps" in push and "disjoint" in push.get("layout", ""):
    link = min(1.0, push["push_gbps"] * GB / hw.nvlink_bandwidth)
    eff = dataclasses.replace(eff, link=link)
    notes.append(f"link {base.link:.2f} -> {link:.3f}: weight push {push['push_gbps']:.1f} GB/s ({push['layout']})")
  elif "push_gbps" in push:
    notes.append(f"link {base.link:.2f} kept: the weight push ran on one device ({push['push_gbps']:.1f} GB/s, "
                 f"{push['push_s'] / push['copy_s']:.1f}x a plain copy), nothing crossed a link")
  return eff, hw, notes


# ------------------------------------------------------------------------------------------------
# report


@dataclass(frozen=True)
class PaperComparison:
  size: str
  gpus: int
  sync: StepPrediction
  async_: StepPrediction
  paper_sync: float
  paper_async: float

  @property
  def sync_error(self) -> float:
    return self.sync.total / self.paper_sync - 1

  @property
  def async_error(self) -> float:
    return self.async_.total / self.paper_async - 1


def compare_with_paper(work: Workload = PAPER_WORKLOAD, hw: Hardware = Hardware(),
                       eff: Efficiency = CALIBRATED) -> list[PaperComparison]:
  """Predictions for the paper's three configurations, beside its published step times."""
  return [PaperComparison(size, gpus, choose_sync_layout(LLAMA3[size], gpus, work, hw, eff),
                          choose_async_layout(LLAMA3[size], gpus, work, hw, eff), *PAPER[(size, gpus)])
          for size, gpus in PAPER]


def paper_table(rows: list[PaperComparison]) -> str:
  lines = ["| model | GPUs | sync s (paper) | err | async s (paper) | err | speed-up (paper) | weight sync s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r.size} | {r.gpus} | {r.sync.total:.1f} ({r.paper_sync}) | {r.sync_error:+.0%} | "
                 f"{r.async_.total:.1f} ({r.paper_async}) | {r.async_error:+.0%} | "
                 f"{r.sync.total / r.async_.total:.1f}x ({r.paper_sync / r.paper_async:.1f}x) | "
                 f"{r.async_.weight_sync:.2f} |")
  return "\n".join(lines)


def describe(pred: StepPrediction) -> str:
  """Layouts, time breakdown and memory plans of one prediction, a few lines."""
  head = (f"{pred.mode}: {pred.total:.1f} s = overhead {pred.overhead:.1f} + "
          + (f"generate {pred.generate:.1f} + train {pred.train:.1f} + reshard {pred.weight_sync:.2f}"
             if pred.mode == "sync" else
             f"max(generate {pred.generate:.1f}, train {pred.train:.1f}) + weight sync {pred.weight_sync:.2f}"))
  body = [f"  trainer {pred.trainer}, generator {pred.generator}"] + [f"  {m}" for m in pred.memory]
  return "\n".join([head] + body)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description="LlamaRL step-time and memory model (see the module docstring).")
  parser.add_argument("--size", choices=list(MODELS), help="plan one model instead of the paper table")
  parser.add_argument("--gpus", type=int, help="GPU count for --size")
  parser.add_argument("--quantize", default="fp8", choices=("fp8", "bf16"), help="async generator weights")
  parser.add_argument("--this_repo", action="store_true",
                      help="model this repo's implementation: bf16 generator, fsdp x tp meshes (no pp), "
                           "the slot engine's streaming generation, rows padded to the max")
  parser.add_argument("--calibrate", metavar="RESULTS_JSON",
                      help="the JSON of `make bench-gpu`: measured efficiencies replace the assumed ones, "
                           "then the paper's configurations are predicted with them")
  for f in dataclasses.fields(Workload):
    if f.type in ("int", int):
      parser.add_argument(f"--{f.name}", type=int, default=f.default)
  args = parser.parse_args(argv)
  eff = CALIBRATED
  if args.calibrate:
    with open(args.calibrate) as fh:
      results = json.load(fh)
    try:
      eff, measured_hw, notes = calibrate(results)
    except (ValueError, KeyError) as e:
      parser.error(f"--calibrate {args.calibrate}: {e}")
    env = results.get("environment", {})
    print(f"calibrated from {args.calibrate} ({env.get('device', '?')}, {results.get('date', '?')}):")
    print("\n".join(f"  {n}" for n in notes))
    print("(fractions of the measured device's peaks; the predictions below apply them to H100 nodes)\n")
  work = Workload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Workload) if f.type in ("int", int)},
                  packed=not args.this_repo)
  print(f"workload: {work} ({work.sequences} sequences, {work.train_tokens / 1e6:.2f}M train tokens)")
  print(f"hardware: {Hardware()}\ncalibration: {eff}\n")
  if args.size:
    if not args.gpus:
      parser.error("--size needs --gpus")
    model = MODELS[args.size]
    print(f"{model.name} ({model.params / 1e9:.1f}B params) on {args.gpus} GPUs")
    repo = dict(quantize="bf16", max_pp=1, streaming=True) if args.this_repo else dict(quantize=args.quantize)
    for mode, kw in (("async", repo), ("sync", {})):
      try:
        pred = choose_layout(model, args.gpus, work, mode=mode, eff=eff, **kw)
      except ValueError as e:
        print(f"{mode}: {e}")
        continue
      print(describe(pred))
      if mode == "async" and args.this_repo:
        print("  run bindings:", controller_bindings(model, pred, work, eff=eff))
    return
  rows = compare_with_paper(work, eff=eff)
  print(paper_table(rows))
  for r in rows:
    print(f"\n{LLAMA3[r.size].name} on {r.gpus} GPUs")
    print(describe(r.sync))
    print(describe(r.async_))


if __name__ == "__main__":
  main()
