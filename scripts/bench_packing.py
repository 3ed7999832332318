"""Token efficiency of the trainer's layouts: real tokens / computed tokens, padded vs grouped by length
vs packed, from the rows' lengths alone (no model runs: the positions a step's forward computes are a
function of the layout).

  padded:   every row at the batch's width P + R: B * (P + R) positions;
  grouped:  `group_by_length` into M microbatches of B/M rows, each at its longest row's rung:
            B/M * sum(widths) (one compiled program per width seen);
  packed:   `pack_rows` into rows of T = tokens_per_microbatch tokens: bins * T (one program).

Workloads: `make run`'s batches (configs/tiny_cpu.gin: 16 arithmetic prompts x 8 samples, the char
tokenizer, P = the prompt bucket, R = 8; responses as the warm-started policy writes them: the
reference answer + EOS) and a long-tail RL batch at 1B shapes (64 rows, prompts of 512 tokens,
responses log-normal with mean 1024 tokens, sigma 1, capped at 8192). Each over `--batches` batches.

    python scripts/bench_packing.py [--batches 50]

--compile_h100 packed|padded: instead, compile the long-tail batch's train step at Llama-3.2-1B shapes
(bf16, remat 'matmuls', cuDNN attention) for an H100 on this machine, no GPU attached, and print
whether cuDNN's fused attention (forward, backward) is in it, any `[T, T]` array, and XLA's memory
analysis. packed: `tokens_per_microbatch` = P + R = 8704; padded: `--microbatches` of 64 / M rows at
P + R. Needs the CUDA-lowering virtualenv (shared/GPU.md) and ptxas on PATH, e.g.

    PATH=$VENV/lib/python3.11/site-packages/nvidia/cuda_nvcc/bin:$PATH JAX_PLATFORMS=cpu,cuda \
      JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 $VENV/bin/python scripts/bench_packing.py --compile_h100 packed
"""

from __future__ import annotations

import argparse

import numpy as np

from llamarl_jax.train.layout import group_by_length, pack_rows


def layouts(batches: list[np.ndarray], width: int, microbatches: list[int], tokens: list[int]) -> list[tuple]:
  """(layout, computed / real tokens averaged over the batches (max), programs compiled) per layout."""
  real = np.array([b.sum() for b in batches], np.float64)
  rows = []
  ratio = lambda computed: (float(np.mean(computed / real)), float(np.max(computed / real)))
  rows.append(("padded", *ratio(np.array([len(b) * width for b in batches])), 1))
  for m in microbatches:
    groups = [group_by_length(b, m, width) for b in batches]
    computed = np.array([len(b) // m * sum(g.widths) for b, g in zip(batches, groups)])
    widths = {w for g in groups for w in g.widths}
    rows.append((f"grouped, {m} microbatches of {len(batches[0]) // m} rows", *ratio(computed), len(widths)))
  for t in tokens:
    plans = [pack_rows(b, t) for b in batches]
    rows.append((f"packed, {t} tokens a row", *ratio(np.array([p.bins * t for p in plans])), 1))
  return rows


def make_run_batches(n: int) -> tuple[list[np.ndarray], int]:
  """Row lengths of `make run`'s batches (prompt + reference answer + EOS, capped at R = 8) and P + R."""
  from llamarl_jax.data import PromptSource
  from llamarl_jax.generation.sampler import DEFAULT_PROMPT_BUCKETS
  from llamarl_jax.tokenizer import make_char_tokenizer

  tok = make_char_tokenizer()
  source = PromptSource(task="arithmetic", seed=0, task_kwargs={"min_digits": 1, "max_digits": 2, "num_operands": 2,
                                                                 "ops": "+", "demo_prefix": "ans ",
                                                                 "demo_prefix_rate": 0.7})
  batches, width = [], 0
  for _ in range(n):
    examples = source.next_batch(16)
    prompts = [len(tok(source.format_prompt(ex.question), add_special_tokens=False)["input_ids"]) for ex in examples]
    answers = [min(len(tok(source.reference(ex), add_special_tokens=False)["input_ids"]) + 1, 8) for ex in examples]
    batches.append(np.repeat(np.array(prompts) + np.array(answers), 8))
    bucket = next(b for b in sorted(DEFAULT_PROMPT_BUCKETS) if b >= max(prompts))
    width = max(width, bucket + 8)
  return batches, width


def long_tail_batches(n: int, seed: int = 0) -> tuple[list[np.ndarray], int]:
  """64 rows: 512 prompt tokens + a log-normal response (mean 1024, sigma 1, 1..8192); width 512 + 8192."""
  rng = np.random.default_rng(seed)
  sigma = 1.0
  mu = np.log(1024) - sigma ** 2 / 2
  out = [512 + np.clip(np.round(rng.lognormal(mu, sigma, 64)), 1, 8192).astype(np.int64) for _ in range(n)]
  return out, 512 + 8192


def compile_h100(layout: str, microbatches: int) -> None:
  """The long-tail step compiled for an H100 (see the module docstring)."""
  import re
  import time
  from pathlib import Path

  from jax.experimental import topologies

  from llamarl_jax import compat, parallel
  from llamarl_jax.executors.trainer import TrainerExecutor, TrainLayout
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import abstract_model, split_params

  text = (Path(__file__).resolve().parent / "gpu_targets" / "h100_sxm.pbtxt").read_text()
  mesh = parallel.make_mesh(topologies.get_topology_desc("h100", "cuda", target_config=text,
                                                         topology="1x1x1").devices[:1])
  config = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                       tie_word_embeddings=True, dtype="bfloat16")
  B, P, R = 64, 512, 8192
  kw = dict(layout=TrainLayout("packed", P + R)) if layout == "packed" else dict(microbatches=microbatches)
  trainer = TrainerExecutor(config, mesh, split_params(abstract_model(config))[1], attention="cudnn", remat="matmuls",
                            **kw)
  start = time.perf_counter()
  with compat.cudnn_target_compute_capability("9.0"):  # cuDNN's checks read the local GPU's, absent here
    lowered = trainer.lower_step(B, P, R)
    compiled = lowered.compile()
  hlo = lowered.as_text()
  square = sorted({m for m in re.findall(r"tensor<([0-9x]+)x(?:bf16|f32|f16|i1)>", hlo) if f"{P + R}x{P + R}" in m})
  mem = compiled.memory_analysis()
  gib = lambda n: f"{n / 2**30:.2f} GiB"
  print(f"{layout} ({kw}): attention {trainer.attention}; cuDNN fused attention forward "
        f"{'__cudnn$fmhaSoftmax' in hlo}, backward {'__cudnn$fmhaSoftmaxBackward' in hlo}; [T, T] arrays: "
        f"{square or 'none'}; compiled for an H100 in {time.perf_counter() - start:.0f} s; temp "
        f"{gib(mem.temp_size_in_bytes)}, arguments {gib(mem.argument_size_in_bytes)}")


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--batches", type=int, default=50)
  ap.add_argument("--compile_h100", choices=("packed", "padded"), default=None)
  ap.add_argument("--microbatches", type=int, default=16, help="the padded step's, with --compile_h100 padded")
  args = ap.parse_args()
  if args.compile_h100:
    return compile_h100(args.compile_h100, args.microbatches)
  small, small_width = make_run_batches(args.batches)
  tail, tail_width = long_tail_batches(args.batches)
  print(f"make run: 128 rows, P + R = {small_width}, real tokens a row {np.mean([b.mean() for b in small]):.1f}; "
        f"long tail: 64 rows, P + R = {tail_width}, real tokens a row {np.mean([b.mean() for b in tail]):.0f} "
        f"(longest {max(b.max() for b in tail)}); {args.batches} batches each")
  print(f"| workload | layout | computed / real tokens (mean) | worst batch | efficiency | programs |")
  print("|---|---|---|---|---|---|")
  for name, (batches, width, mbs, toks) in {
      "make run": (small, small_width, [1, 8], [small_width, 64, 256]),
      "long tail 1B": (tail, tail_width, [8, 16], [tail_width, 16384, 32768])}.items():
    for layout, mean, worst, programs in layouts(batches, width, mbs, toks):
      print(f"| {name} | {layout} | {mean:.3f}x | {worst:.3f}x | {1 / mean:.1%} | {programs} |")


if __name__ == "__main__":
  main()
