#!/usr/bin/env python
"""Trainer throughput: tokens/s of `TrainerExecutor.step` and model FLOPs utilisation (MFU).

For each size a random-weight policy is put on a mesh over all local devices (fsdp = device count)
and trained on fixed-shape random batches (every prompt and response token valid). The first
--warmup steps (compilation included) are not timed; each timed step ends when its metrics reach
the host. We report the median step time of --steps steps.

  tokens/s   B * (P + R) / step time: every position of the trainer's forward + backward
  MFU        6 * N * B * (P + R) / step time / --peak_tflops, with N = the parameters used in
             matmuls (all but the input embedding gather). The usual 6N-per-token model-FLOPs
             estimate: attention scores and remat recompute are not counted, and the lm_head counted
             at every position although the trainer projects only the R response positions.

  python scripts/bench_train.py                                   # CPU: tiny and 100m
  python scripts/bench_train.py --sizes 1b --dtype bfloat16 --batch 16 --prompt_len 512 \\
      --resp_len 1536 --remat matmuls --microbatches 2 --peak_tflops 989   # H100 (bf16 dense peak)

Looking at the program without running it (no weights allocated: the trainer is built from
abstract shapes, `TrainerExecutor.lower_step`):

  --lower cuda --dump_hlo out.mlir   lower the exact train step for CUDA (on a CPU machine too, with
                                     jax-cuda12-plugin and nvidia-cudnn-cu12 installed: shared/GPU.md),
                                     write its StableHLO text, print the custom calls it makes (cuDNN
                                     fused attention: __cudnn$fmhaSoftmax[Backward]) and the largest
                                     array with a vocabulary-sized dimension (a padded vocabulary too)
  --memory                           compile the step on this backend and print its memory analysis
"""

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path


# name: (vocab, hidden, intermediate, layers, heads, kv_heads, tied)
SIZES = {
    "tiny": (100, 128, 384, 4, 4, 2, True),  # the embedded tiny default (char tokenizer)
    "100m": (32000, 768, 2048, 12, 12, 4, True),
    "400m": (32000, 1024, 2816, 24, 16, 8, False),
    "1b": (128256, 2048, 8192, 16, 32, 8, True),  # Llama 3.2 1B shapes
}


def model_config(name, dtype, layers=None):
  from llamarl_jax.model.config import ModelConfig

  vocab, d, f, size_layers, heads, kv, tied = SIZES[name]
  layers = layers or size_layers
  return ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_layers=layers, num_heads=heads,
                     num_kv_heads=kv, max_position_embeddings=8192, rope_theta=500000.0,
                     tie_word_embeddings=tied, dtype=dtype)


def matmul_params(config) -> int:
  """Parameters that take part in matmuls: all but the embedding table when it is only gathered."""
  embed_only = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
  return config.num_params() - embed_only


def cpu_model():
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def default_peak_tflops() -> tuple[float, str]:
  """A rough fp32 peak for this CPU: cores * 32 FLOP/cycle (2 AVX2 FMA units) * clock."""
  mhz = []
  try:
    mhz = [float(l.split(":")[1]) for l in open("/proc/cpuinfo") if l.startswith("cpu MHz")]
  except OSError:
    pass
  ghz = (max(mhz) / 1000) if mhz else 2.5
  cores = os.cpu_count() or 1
  return cores * 32 * ghz / 1000, f"estimate: {cores} cores x 32 fp32 FLOP/cycle x {ghz:.2f} GHz"


def random_params(config, trainer_shardings, seed=0):
  """Random weights made on the devices, straight onto the trainer's shardings."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from llamarl_jax.model.llama import Llama, split_params

  _, shapes = split_params(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
  leaves, treedef = jax.tree.flatten(shapes)

  def init(key):
    keys = jax.random.split(key, len(leaves))
    out = [jnp.ones(s.shape, jnp.float32) if len(s.shape) == 1 else
           jax.random.normal(k, s.shape, jnp.float32) * (0.02 if s.shape[0] == config.vocab_size else
                                                         s.shape[0] ** -0.5)
           for k, s in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, out)

  return jax.jit(init, out_shardings=trainer_shardings)(jax.random.key(seed))


def random_batch(rng, config, B, P, R):
  import numpy as np

  from llamarl_jax.batch import RolloutBatch, ScoredBatch

  ones = lambda *s: np.ones(s, np.int32)
  rollout = RolloutBatch(
      prompt_tokens=rng.randint(1, config.vocab_size, (B, P)).astype(np.int32), prompt_mask=ones(B, P),
      response_tokens=rng.randint(1, config.vocab_size, (B, R)).astype(np.int32), response_mask=ones(B, R),
      behaviour_logprobs=rng.uniform(-4, -1, (B, R)).astype(np.float32), lengths=np.full(B, R, np.int32),
      finish_reason=np.zeros(B, np.int32), group_ids=np.arange(B, dtype=np.int32) // 4,
      policy_version=np.zeros(B, np.int32), token_versions=np.zeros((B, R), np.int32))
  adv = rng.choice([-1.0, 1.0], B).astype(np.float32)
  return ScoredBatch(rollout=rollout, rewards=(adv > 0).astype(np.float32), advantages=adv)


def make_trainer(config, mesh, args):
  """A TrainerExecutor (AIPO) whose random params are created directly on its shardings."""
  from flax import nnx

  from llamarl_jax import parallel
  from llamarl_jax.executors.trainer import OptimizerConfig, TrainerExecutor
  from llamarl_jax.model.llama import Llama, split_params

  abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
  shardings = parallel.param_shardings(split_params(abstract)[1], parallel.logical_axes(abstract), mesh)
  params = random_params(config, shardings)
  return TrainerExecutor(config, mesh, params, optimizer=OptimizerConfig(lr=1e-5), loss="aipo",
                         loss_kwargs={"rho_max": 2.0}, **trainer_knobs(args))


def trainer_knobs(args) -> dict:
  chunk = args.logprob_chunk if args.logprob_chunk > 0 else None
  return dict(microbatches=args.microbatches, remat=args.remat, attention=args.attention, logprob_chunk=chunk)


def abstract_trainer(config, mesh, args, platform=None):
  """A TrainerExecutor over parameter shapes only (nothing allocated): for lowering its step."""
  from llamarl_jax.executors.trainer import OptimizerConfig, TrainerExecutor
  from llamarl_jax.model.llama import abstract_model, split_params

  shapes = split_params(abstract_model(config))[1]
  return TrainerExecutor(config, mesh, shapes, optimizer=OptimizerConfig(lr=1e-5), loss="aipo",
                         loss_kwargs={"rho_max": 2.0}, platform=platform, **trainer_knobs(args))


def custom_calls(hlo_text: str) -> dict[str, int]:
  """custom_call targets in StableHLO text -> number of call sites."""
  found: dict[str, int] = {}
  for name in re.findall(r"custom_call\s*@([\w$.\-]+)", hlo_text):
    found[name] = found.get(name, 0) + 1
  return found


def largest_vocab_array(hlo_text: str, vocab: int) -> tuple[int, str] | None:
  """(elements, type) of the largest tensor type whose shape has a vocabulary-sized dimension:
  `vocab` itself or a padded vocabulary (vocab <= d < vocab + pad, pad = vocab / 16 capped at 1024)."""
  pad = max(1, min(1024, vocab // 16))
  best = None
  for dims, dtype in set(re.findall(r"tensor<((?:\d+x)+)(\w+)>", hlo_text)):
    shape = [int(d) for d in dims.rstrip("x").split("x")]
    if any(vocab <= d < vocab + pad for d in shape):
      n = 1
      for d in shape:
        n *= d
      if best is None or n > best[0]:
        best = (n, f"tensor<{dims}{dtype}>")
  return best


def lower(name, args):
  """Lower (and with --memory compile) the train step of `name` from abstract shapes; print findings."""
  import jax

  from llamarl_jax import parallel

  config = model_config(name, args.dtype, args.layers)
  devices = jax.devices()
  mesh = parallel.make_mesh(devices, fsdp=len(devices) // args.tp, tp=args.tp)
  row = {"size": name, "B": args.batch, "P": args.prompt_len, "R": args.resp_len, "dtype": args.dtype,
         "mb": args.microbatches, "remat": args.remat}
  if args.lower:
    t0 = time.perf_counter()
    trainer = abstract_trainer(config, mesh, args, platform=args.lower)
    text = trainer.lower_step(args.batch, args.prompt_len, args.resp_len).as_text()
    row.update(lower_s=time.perf_counter() - t0, attention=trainer.attention, hlo_chars=len(text))
    if args.dump_hlo:
      path = Path(args.dump_hlo if len(args.sizes.split(",")) == 1 else f"{args.dump_hlo}.{name}")
      path.write_text(text)
      row["dump"] = str(path)
    calls = custom_calls(text)
    largest = largest_vocab_array(text, config.vocab_size)
    row.update(custom_calls=calls, largest_vocab=largest)
    print(f"{name}: lowered for {args.lower} in {row['lower_s']:.1f} s (attention={trainer.attention}, "
          f"{len(text) / 1e6:.1f} MB of StableHLO{', written to ' + row['dump'] if 'dump' in row else ''})")
    print(f"  custom calls: {calls or 'none'}")
    fused = [k for k in calls if k.startswith("__cudnn$fmha")]
    print(f"  cuDNN fused attention: {', '.join(sorted(fused)) or 'NOT FOUND'}")
    if not fused and "CustomSPMDPartitioning" in calls:
      print("  (on a mesh of several devices the attention kernel sits inside custom partitioning and is "
            "named only after SPMD partitioning: lower on one device to see it)")
    if largest:
      print(f"  largest vocabulary-sized array: {largest[1]} = {largest[0]:,} elements "
            f"({largest[0] / 2 ** 28:.3f} x 2^28)")
  if args.memory:
    t0 = time.perf_counter()
    trainer = abstract_trainer(config, mesh, args)
    compiled = trainer.lower_step(args.batch, args.prompt_len, args.resp_len).compile()
    mem = compiled.memory_analysis()
    gib = lambda b: b / 2 ** 30
    fields = {k: getattr(mem, k, None) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                   "alias_size_in_bytes", "temp_size_in_bytes",
                                                   "generated_code_size_in_bytes")}
    peak = getattr(mem, "peak_memory_in_bytes", None)
    row.update(compile_s=time.perf_counter() - t0, memory={k: v for k, v in fields.items() if v is not None},
               peak=peak)
    print(f"{name}: compiled on {devices[0].platform} in {row['compile_s']:.1f} s (attention={trainer.attention}); "
          "memory analysis per device:")
    for k, v in row["memory"].items():
      print(f"  {k}: {gib(v):.3f} GiB")
    if peak is not None:
      print(f"  peak_memory_in_bytes: {gib(peak):.3f} GiB")
  return row


def bench(name, args, peak_tflops):
  import jax
  import numpy as np

  from llamarl_jax import parallel

  config = model_config(name, args.dtype, args.layers)
  devices = jax.devices()
  mesh = parallel.make_mesh(devices, fsdp=len(devices) // args.tp, tp=args.tp)
  trainer = make_trainer(config, mesh, args)
  rng = np.random.RandomState(0)
  B, P, R = args.batch, args.prompt_len, args.resp_len
  batches = [random_batch(rng, config, B, P, R) for _ in range(2)]  # alternate: new data every step
  t0 = time.perf_counter()
  for i in range(args.warmup):
    trainer.step(batches[i % 2])
  warmup_s = time.perf_counter() - t0
  times = [trainer.step(batches[i % 2])["time/train_step"] for i in range(args.steps)]
  profile_dir = getattr(args, "profile", None)
  if profile_dir:  # one more step under the profiler (bench_gpu's profile section reads its trace)
    from scripts import bench_generate
    with bench_generate.profiled(profile_dir, "train_step"):
      trainer.step(batches[0])
  step_s = statistics.median(times)
  tokens = B * (P + R)
  n = matmul_params(config)
  tflops = 6 * n * tokens / step_s / 1e12
  return {"size": name, "params": config.num_params(), "B": B, "P": P, "R": R, "dtype": args.dtype,
          "mb": args.microbatches, "remat": args.remat, "attention": trainer.attention,
          "chunk": trainer.logprob_chunk, "step_s": step_s, "tokens_per_s": tokens / step_s,
          "resp_tokens_per_s": B * R / step_s, "tflops": tflops, "mfu": tflops / peak_tflops,
          "warmup_s": warmup_s, "compiles": trainer.trace_count}


def build_parser() -> argparse.ArgumentParser:
  """The command line (also the defaults other scripts start from: `build_parser().parse_args([])`)."""
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="tiny,100m", help=f"comma-separated, from {sorted(SIZES)}")
  parser.add_argument("--batch", type=int, default=None, help="rows per step (default: 32 tiny, 8 otherwise)")
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--resp_len", type=int, default=64)
  parser.add_argument("--dtype", default="float32", help="compute dtype (params stay fp32)")
  parser.add_argument("--microbatches", type=int, default=1)
  parser.add_argument("--layers", type=int, default=None, help="override the size's number of layers")
  parser.add_argument("--remat", nargs="?", const="full", default="none", choices=("none", "matmuls", "full"),
                      help="activation recomputation: none, matmuls (save matmul outputs), full (--remat alone)")
  parser.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"),
                      help="trainer attention kernel (auto: cuDNN on a GPU in bf16, XLA elsewhere)")
  parser.add_argument("--logprob_chunk", type=int, default=256,
                      help="positions per chunk of the lm_head + log-prob (0: unchunked)")
  parser.add_argument("--lower", default=None, metavar="PLATFORM",
                      help="only lower the step for PLATFORM (e.g. cuda) from abstract shapes; no run")
  parser.add_argument("--dump_hlo", default=None, metavar="PATH", help="with --lower: write the StableHLO here")
  parser.add_argument("--memory", action="store_true",
                      help="only compile the step on this backend and print its memory analysis; no run")
  parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the rest is fsdp)")
  parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation included)")
  parser.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
  parser.add_argument("--peak_tflops", type=float, default=None,
                      help="device peak for MFU (e.g. 989 for H100 bf16 dense); default: a CPU estimate")
  parser.add_argument("--out", default=None, help="also append the section to this markdown file")
  return parser


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)

  import jax

  if args.dump_hlo and not args.lower:
    parser.error("--dump_hlo needs --lower PLATFORM")
  if args.lower or args.memory:
    rows = []
    for name in args.sizes.split(","):
      size_args = argparse.Namespace(**vars(args))
      if size_args.batch is None:
        size_args.batch = 32 if name == "tiny" else 8
      rows.append(lower(name, size_args))
    return rows

  platform_name = jax.devices()[0].platform
  if args.peak_tflops is None:
    if platform_name != "cpu":
      parser.error("--peak_tflops is required on accelerators (e.g. 989 for an H100 in bf16)")
    peak, peak_note = default_peak_tflops()
  else:
    peak, peak_note = args.peak_tflops, "--peak_tflops"

  rows = []
  for name in args.sizes.split(","):
    size_args = argparse.Namespace(**vars(args))
    if size_args.batch is None:
      size_args.batch = 32 if name == "tiny" else 8
    row = bench(name, size_args, peak)
    rows.append(row)
    print(f"{name}: {row['tokens_per_s']:.0f} tokens/s, step {row['step_s'] * 1e3:.1f} ms, "
          f"MFU {100 * row['mfu']:.2f}%", flush=True)

  header = ("| size | params | B x (P+R) | dtype | microbatches | remat | attention | lm_head chunk | step (ms) | "
            "tokens/s | response tokens/s | TFLOP/s | MFU |")
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for r in rows:
    lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['B']} x ({r['P']}+{r['R']}) | {r['dtype']} | "
                 f"{r['mb']} | {r['remat']} | {r['attention']} | {r['chunk']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                 f"{r['resp_tokens_per_s']:.0f} | {r['tflops']:.3f} | {100 * r['mfu']:.2f}% |")
  table = "\n".join(lines)
  devices = jax.devices()
  machine = (f"{platform_name} x{len(devices)} ({devices[0].device_kind}); host: {os.cpu_count()} CPUs "
             f"({cpu_model()}), nproc={len(os.sched_getaffinity(0))}")
  command = "python scripts/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:])
  section = (f"\n## {datetime.date.today().isoformat()}: {platform_name}\n\n"
             f"- command: `{command.strip()}`\n- machine: {machine}\n- jax {jax.__version__}\n"
             f"- peak for MFU: {peak:.3f} TFLOP/s ({peak_note})\n"
             f"- timed: median of {args.steps} steps after {args.warmup} warm-up steps (compile excluded)\n\n"
             f"{table}\n")
  print(section)
  if args.out:
    with Path(args.out).open("a") as f:
      f.write(section)
  return rows


if __name__ == "__main__":
  main()
