"""The predictions of the step-time and memory model (`perf_model`): ring collectives, the per-GPU
memory plans, the time of each phase (train, decode, generate, weight sync, reshard), the synchronous
and asynchronous RL steps, the choice of the fastest layouts that fit, and the Controller bindings
that realise a prediction in this repo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llamarl_jax.measure.perf_inputs import (CALIBRATED, GB, MODELS, PAPER_WORKLOAD, Efficiency, GeneratorLayout,
                                             Hardware, ModelShape, TrainerLayout, Workload)


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

