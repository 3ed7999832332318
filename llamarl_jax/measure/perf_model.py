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

The model is in four modules: `perf_inputs` (shapes, hardware, efficiencies, workload, layouts, the
paper's figures), `perf_predict` (memory plans, phase and step times, the layout choice, Controller
bindings), `perf_calibrate` (efficiencies from measurements) and this one (the comparison with the
paper, the report and the CLI), which re-exports every name of the other three.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from llamarl_jax.measure.perf_calibrate import calibrate, shape_from_json
from llamarl_jax.measure.perf_inputs import (CALIBRATED, GB, LLAMA3, LLAMA32_1B, MODELS, PAPER,
                                             PAPER_MAX_SYNC_SECONDS, PAPER_WORKLOAD, QWEN, Efficiency,
                                             GeneratorLayout, Hardware, ModelShape, TrainerLayout, Workload)
from llamarl_jax.measure.perf_predict import (MemoryPlan, StepPrediction, async_step, choose_async_layout,
                                              choose_layout, choose_sync_layout, collective_seconds,
                                              controller_bindings, decode_step_seconds, gen_weight_bytes,
                                              generate_seconds, generator_memory, kv_bytes_per_sequence, kv_slots,
                                              microbatch_tokens, reshard_seconds, sync_step, train_seconds,
                                              trainer_activation_bytes, trainer_layouts, trainer_memory,
                                              trainer_state_bytes, weight_sync_seconds)

__all__ = ["CALIBRATED", "GB", "LLAMA3", "LLAMA32_1B", "MODELS", "PAPER", "PAPER_MAX_SYNC_SECONDS", "PAPER_WORKLOAD",
           "QWEN", "Efficiency", "GeneratorLayout", "Hardware", "ModelShape", "TrainerLayout", "Workload",
           "MemoryPlan", "StepPrediction", "async_step", "choose_async_layout", "choose_layout", "choose_sync_layout",
           "collective_seconds", "controller_bindings", "decode_step_seconds", "gen_weight_bytes", "generate_seconds",
           "generator_memory", "kv_bytes_per_sequence", "kv_slots", "microbatch_tokens", "reshard_seconds",
           "sync_step", "train_seconds", "trainer_activation_bytes", "trainer_layouts", "trainer_memory",
           "trainer_state_bytes", "weight_sync_seconds", "calibrate", "shape_from_json", "PaperComparison",
           "compare_with_paper", "describe", "main", "paper_table"]


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
