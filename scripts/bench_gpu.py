#!/usr/bin/env python
"""The GPU benchmark in one command (`make bench-gpu`): the numbers that matter, as a markdown table
and a JSON file (the input of `python -m llamarl_jax.measure.perf_model --calibrate`). Each section prints
its own seconds; the whole command has not run end to end on a GPU (BENCHMARKS.md).

Sections (Llama-3.2-1B shapes, random weights, bf16 unless said):
  trainer     `TrainerExecutor.step` at RL shapes (16 x (512 + 1536), 2 microbatches, remat
              saving matmul outputs, cuDNN attention, lm_head in chunks): step time,
              MFU = 6 N B (P + R) / step / peak, peak device memory (scripts/bench_train.bench)
  torch_peer  the same shapes in PyTorch (transformers Llama, sdpa, bf16 autocast, AdamW, gradient
              checkpointing): step, MFU, peak memory. Only when torch sees CUDA (skipped otherwise)
  attention   `jax.nn.dot_product_attention` forward + backward, causal with per-row lengths
              (B4, T2048, 32/8 heads, head dim 64): XLA with a mask, XLA causal, cuDNN causal
  decode      greedy decode per step at B16 / B64 / B256 (prompt 128) vs the HBM roofline
              (scripts/bench_generate: weights + mean valid KV bytes per step / step / peak bandwidth),
              with the weights in the compute dtype and in fp8 (GeneratorConfig.quantize='fp8'; with
              --fp8_lm_head the fp8 rows' lm_head in fp8 too, GeneratorConfig.quantize='fp8+lm_head')
  transformers the same weights in transformers (bf16, `generate`, dynamic cache, no torch.compile),
              decode per step at B64; skipped when torch has no CUDA
  engine      slot engine vs static sampler on a long-tail workload and one of equal lengths (every slot
              busy: the engine's ms per decode step): tokens/s, slot utilization (and an ideal
              scheduler's), device idle, the engine's warm-up (its program set compiled, or loaded from
              the persistent cache) and program count, per KV block size and attention form
              (scripts/bench_generate.engine_table)
  profile     a JAX profiler trace of slot-engine decode chunks (every slot busy) and of one trainer
              step: the top 20 kernels by GPU time (name, count, total microseconds, share) and the
              kernels launched per decode step, read from the trace's JSON (no new dependencies)
  bytes       one paged decode step's bytes (XLA's cost analysis of the program compiled for this GPU)
              vs weights + live KV, per KV block size and attention form
              (scripts/bench_generate.bytes_table; compile only)
  weight_push `WeightSync.push` (fp32 trainer params -> bf16 generator layout) in GB/s against a plain
              copy of the same bytes: device to device between disjoint meshes with 2+ GPUs
              (scripts/bench_weight_sync.bench_one), an on-device copy with one GPU (colocated mode)
  e2e         whole runs of `scripts/train.py`'s job, each in a fresh process: configs/llama3_1b_1gpu.gin
              (Llama-3.2-1B shapes, random weights, colocated, slot engine, bf16 generator) for a few RL
              steps: seconds per step after the first, generated tokens/s, the time breakdown, peak device
              memory against the memory plan (and their ratio, peak / plan); and `make run`'s configs/tiny_cpu.gin to its end, colocated
              on one GPU: held-out accuracy before and after RL, and its breakdown

It checks its environment first and stops with a clear message when JAX sees no GPU. `--dry_run` runs
every section at toy sizes on whatever backend is present (CPU included), cuDNN and the PyTorch CUDA
parts skipped, so the script itself is tested (tests/test_bench_scripts.py).

  make bench-gpu                                    # = python -m scripts.bench_gpu --out results/bench_gpu
  python -m scripts.bench_gpu --sections decode,trainer --out /tmp/bench
  JAX_PLATFORMS=cpu python -m scripts.bench_gpu --dry_run --out /tmp/dry
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU; peak memory is real
from llamarl_jax import compat  # noqa: E402  (no jax import: before JAX starts)

compat.ensure_cpu_devices(1)  # before bench_weight_sync's 8

ROOT = Path(__file__).resolve().parents[1]

from scripts import bench_generate
from scripts import bench_train
from scripts import bench_weight_sync

SECTIONS = ("trainer", "torch_peer", "attention", "decode", "transformers", "engine", "profile", "bytes", "weight_push",
            "e2e")
# device kind substring: (dense bf16 peak FLOP/s, HBM bytes/s)
DEVICE_PEAKS = {"H100 PCIe": (756e12, 2.0e12), "H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12),
                "A100": (312e12, 2.0e12), "L4": (121e12, 0.3e12)}

# what each section runs at: full size on a GPU, toy size for --dry_run
FULL = dict(size="1b", train_B=16, train_P=512, train_R=1536, microbatches=2, train_remat="matmuls",
            train_warmup=2, train_steps=3,
            attn=(4, 2048, 32, 8, 64), decode_batches=(16, 64, 256), prompt_len=128, decode_R=64, hf_batch=64,
            engine_slots=64, engine_prompts=256, engine_R=512, engine_workloads="longtail,equal",
            # (KV block, attention, staged slots): auto = the Pallas kernel on one GPU, reduce = XLA's form
            engine_variants=((16, "auto", 0), (16, "reduce", 0), (16, "auto", 64)),
            profile_chunks=4,
            bytes_size="1b",
            bytes_slots=64, bytes_cache=2048, bytes_live="100,500", push_size="1b",
            e2e=(("llama3_1b_1gpu", "llama3_1b_1gpu.gin", ("run_experiment.rl_steps = 5",)),
                 ("tiny_cpu", "tiny_cpu.gin", ())),
            repeats=3)
DRY = dict(size="tiny", train_B=16, train_P=8, train_R=8, microbatches=2, train_remat="matmuls", train_warmup=1,
           train_steps=1,
           attn=(1, 64, 4, 2, 16), decode_batches=(2,), prompt_len=8, decode_R=4, hf_batch=2,
           engine_slots=4, engine_prompts=8, engine_R=8, engine_workloads="longtail,equal", engine_variants=((16, "auto", 0), (4, "pallas", 0), (16, "auto", 4)),
           profile_chunks=2,
           bytes_size="5m", bytes_slots=4,
           bytes_cache=64, bytes_live="20,40", push_size="1m",
           e2e=(("llama3_1b_1gpu", "llama3_1b_1gpu.gin", (
               "ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
               "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 8",
               "build_policy.vocab_size = 160", "RolloutConfig.prompts_per_step = 2",
               "RolloutConfig.samples_per_prompt = 4", "RolloutConfig.max_new_tokens = 8", "GeneratorConfig.slots = 8",
               "GeneratorConfig.max_prompt_len = 16", "TrainConfig.microbatches = 2", "run_experiment.rl_steps = 3")),
                ("tiny_cpu", "tiny_cpu.gin", (
                    "ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
                    "supervised_warmstart.steps = 10", "supervised_warmstart.batch_size = 16",
                    "run_experiment.rl_steps = 3", "run_experiment.eval_size = 16", "run_experiment.eval_every = 0",
                    "run_experiment.eval_samples = 0", "RolloutConfig.prompts_per_step = 4"))),
           repeats=1)
# `make run`'s config on one GPU: trainer and generator colocated on it (the config's own meshes need 4 devices)
ONE_DEVICE = ("MeshConfig.trainer_fsdp = 1", "MeshConfig.generator_dp = 1", "MeshConfig.colocated = True")
DRY_DECODE_SIZE = "5m"  # bench_generate's smallest


class SkipSection(Exception):
  """A section that cannot run here (its reason goes into the report)."""


# ------------------------------------------------------------------------------------------------
# environment


def check_environment(dry_run: bool) -> dict:
  """What this machine is; SystemExit with what to do when there is no GPU (and not --dry_run)."""
  try:
    import jax

    devices = jax.devices()
  except RuntimeError as e:  # e.g. JAX_PLATFORMS=cuda without a driver / plugin
    raise SystemExit(f"bench_gpu: JAX could not start its backend ({e}). On a CUDA machine: "
                     "pip install -e '.[cuda12]' (or jax[cuda12]) and run `make bench-gpu`.") from e
  backend = jax.default_backend()
  if backend != "gpu" and not dry_run:
    raise SystemExit(
        f"bench_gpu needs a GPU, but JAX's backend is {backend!r} ({devices[0].device_kind}, "
        f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}). On a CUDA machine: "
        "pip install -e '.[cuda12]' and run `make bench-gpu` (without JAX_PLATFORMS=cpu). "
        "To exercise this script on CPU at toy sizes: --dry_run.")
  missing = [m for m in ("gin", "tensorboardX", "transformers") if not _importable(m)]
  if missing:
    raise SystemExit(f"bench_gpu: missing packages {missing}: pip install -e '.[test,cuda12]'")
  kind = devices[0].device_kind
  peak_flops, peak_bw = next((v for k, v in DEVICE_PEAKS.items() if k in kind), (None, None))
  torch_cuda = False
  if _importable("torch"):
    import torch

    torch_cuda = bool(torch.cuda.is_available())
  return {"backend": backend, "device": kind, "device_count": len(devices), "jax": jax.__version__,
          "torch_cuda": torch_cuda, "peak_flops": peak_flops, "peak_bandwidth": peak_bw, "dry_run": dry_run}


def _importable(name: str) -> bool:
  import importlib.util

  return importlib.util.find_spec(name) is not None


def peak_memory_bytes() -> float | None:
  """The device's peak bytes in use so far (None where the backend keeps no statistics, e.g. CPU)."""
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


# ------------------------------------------------------------------------------------------------
# sections


def trainer_section(cfg, env, args) -> dict:
  ns = bench_train.build_parser().parse_args([])  # bench_train's defaults (attention auto, lm_head chunks)
  ns.__dict__.update(dtype=args.dtype, microbatches=cfg["microbatches"], remat=cfg["train_remat"], tp=1,
                     batch=cfg["train_B"],
                     prompt_len=cfg["train_P"], resp_len=cfg["train_R"], warmup=cfg["train_warmup"],
                     steps=cfg["train_steps"])
  peak = args.peak_tflops or (env["peak_flops"] or 0) / 1e12 or bench_train.default_peak_tflops()[0]
  row = bench_train.bench(cfg["size"], ns, peak)
  vocab, d, f, layers, heads, kv, tied = bench_train.SIZES[cfg["size"]]
  row["shape"] = dict(name=cfg["size"], layers=layers, hidden=d, heads=heads, kv_heads=kv, intermediate=f,
                      vocab=vocab, tied=tied)  # for perf_model --calibrate
  row["peak_tflops"] = peak
  row["peak_memory_gib"] = _gib(peak_memory_bytes())
  return row


def torch_peer_section(cfg, env, args) -> dict:
  """transformers' Llama at the trainer section's shapes: fp32 master weights, bf16 autocast on CUDA,
  sdpa attention, gradient checkpointing, AdamW; the loss uses the response positions' log-probs."""
  import torch
  import transformers

  on_cuda = env["torch_cuda"]
  if not on_cuda and not env["dry_run"]:
    raise SkipSection("torch has no CUDA")
  device = "cuda" if on_cuda else "cpu"
  vocab, d, f, layers, heads, kv, tied = bench_train.SIZES[cfg["size"]]
  hf = transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                                max_position_embeddings=8192, rope_theta=500000.0, attn_implementation="sdpa")
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(hf).to(device)
  model.gradient_checkpointing_enable()
  model.train()
  opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
  B, P, R, M = cfg["train_B"], cfg["train_P"], cfg["train_R"], cfg["microbatches"]
  g = torch.Generator().manual_seed(0)
  tokens = torch.randint(1, vocab, (B, P + R), generator=g).to(device)
  adv = (torch.randint(0, 2, (B,), generator=g).float() * 2 - 1).to(device)

  def step():
    opt.zero_grad(set_to_none=True)
    for mb in range(M):
      rows = slice(mb * B // M, (mb + 1) * B // M)
      with torch.autocast(device, dtype=torch.bfloat16, enabled=on_cuda):
        hidden = model.model(input_ids=tokens[rows]).last_hidden_state[:, P - 1:-1]
        logits = model.lm_head(hidden).float()
      logp = torch.log_softmax(logits, -1).gather(-1, tokens[rows, P:, None])[..., 0]
      loss = -(adv[rows, None] * logp).mean() / M
      loss.backward()
    opt.step()
    if on_cuda:
      torch.cuda.synchronize()

  for _ in range(cfg["train_warmup"]):
    step()
  if on_cuda:
    torch.cuda.reset_peak_memory_stats()
  times = []
  for _ in range(cfg["train_steps"]):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
  step_s = statistics.median(times)
  n = sum(p.numel() for p in model.parameters()) - (0 if tied else vocab * d)
  peak = args.peak_tflops or (env["peak_flops"] or 0) / 1e12 or bench_train.default_peak_tflops()[0]
  tflops = 6 * n * B * (P + R) / step_s / 1e12
  return {"size": cfg["size"], "B": B, "P": P, "R": R, "mb": M, "step_s": step_s, "tflops": tflops,
          "mfu": tflops / peak, "peak_memory_gib": _gib(torch.cuda.max_memory_allocated()) if on_cuda else None,
          "device": device}


def attention_section(cfg, env, args) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  B, T, N, K, H = cfg["attn"]
  dtype = jnp.dtype(args.dtype)
  rng = np.random.RandomState(0)
  q, k, v = (jnp.asarray(rng.normal(size=(B, T, n, H)), dtype) for n in (N, K, K))
  lengths = jnp.asarray(np.linspace(T, T // 2, B).astype(np.int32))
  positions = np.arange(T)
  valid = positions[None, :] < np.asarray(lengths)[:, None]
  mask = jnp.asarray((positions[:, None] >= positions[None, :])[None, None] & valid[:, None, None, :])

  variants = {
      "xla, boolean mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"),
      "xla, causal + lengths": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation="xla"),
      "cudnn, causal + lengths": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
          implementation="cudnn"),
  }
  flops = 3.5 * 2 * B * N * T * T * H  # causal forward 2BNT^2H (half of 4BNT^2H), backward 2.5x the forward
  rows = []
  for name, fn in variants.items():
    if name.startswith("cudnn") and env["backend"] != "gpu":
      rows.append({"implementation": name, "skipped": "cuDNN needs a GPU"})
      continue
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    run = lambda: jax.block_until_ready(grad(q, k, v))
    run()
    (t,) = bench_generate.best_times([run], max(cfg["repeats"], 3))
    rows.append({"implementation": name, "ms": t * 1e3, "tflops": flops / t / 1e12})
  return {"shape": {"B": B, "T": T, "heads": N, "kv_heads": K, "head_dim": H, "dtype": dtype.name}, "rows": rows}


def _decode_model(cfg, args, env):
  import jax.numpy as jnp

  from llamarl_jax.model import init_model
  from llamarl_jax.model.hf import config_from_hf

  name = DRY_DECODE_SIZE if env["dry_run"] else cfg["size"]
  config = config_from_hf(bench_generate.hf_config(name).to_dict(), dtype=jnp.dtype(args.dtype))
  return name, config, init_model(config, seed=0)


def decode_section(cfg, env, args) -> dict:
  import jax.numpy as jnp
  import numpy as np

  name, config, model = _decode_model(cfg, args, env)
  P, R = cfg["prompt_len"], cfg["decode_R"]
  peak_bw = args.peak_bandwidth or env["peak_bandwidth"] or 0.0
  rng = np.random.RandomState(0)
  rows = []
  fp8 = "fp8+lm_head" if args.fp8_lm_head else "fp8"
  for quantize in (None, fp8):  # the generator's weights in the compute dtype, then in fp8 (fp8 GEMMs)
    for B in cfg["decode_batches"]:
      prompts = rng.randint(1, config.vocab_size, (B, P)).tolist()
      ours = bench_generate.our_runner(config, model, prompts, quantize=quantize)
      ours(R), ours(1)  # compile both lengths
      full, one = bench_generate.best_times([lambda: ours(R), lambda: ours(1)], cfg["repeats"])
      step = (full - one) / (R - 1)
      frac = (bench_generate.decode_roofline(config, B, P, R, step, jnp.dtype(args.dtype).itemsize, peak_bw,
                                             weight_bytes=ours.weight_bytes) if peak_bw else None)
      rows.append({"weights": quantize or jnp.dtype(args.dtype).name, "batch": B, "step_ms": step * 1e3,
                   "tokens_per_s": B / step, "roofline": frac, "weight_bytes": ours.weight_bytes})
  vocab, d, f, layers, heads, kv = bench_generate.SIZES[name]
  shape = dict(name=name, layers=layers, hidden=d, heads=heads, kv_heads=kv, intermediate=f, vocab=vocab, tied=False)
  return {"model": name, "params": config.num_params(), "prompt_len": P, "new_tokens": R, "rows": rows,
          "shape": shape}


def transformers_section(cfg, env, args) -> dict:
  """Our decode and transformers' `generate` on the same weights (ours exported with
  `save_hf_checkpoint`), greedy, B = hf_batch; per-step time with prefill subtracted on both sides."""
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  from llamarl_jax.model import save_hf_checkpoint

  on_cuda = env["torch_cuda"]
  if not on_cuda and not env["dry_run"]:
    raise SkipSection("torch has no CUDA")
  device = "cuda" if on_cuda else "cpu"
  name, config, model = _decode_model(cfg, args, env)
  B, P, R = cfg["hf_batch"], cfg["prompt_len"], cfg["decode_R"]
  prompts = np.random.RandomState(1).randint(1, config.vocab_size, (B, P))
  with tempfile.TemporaryDirectory() as tmp:
    save_hf_checkpoint(model, config, tmp)
    torch_dtype = torch.bfloat16 if jnp.dtype(args.dtype) == jnp.bfloat16 else torch.float32
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch_dtype).to(device).eval()
  ids = torch.tensor(prompts, device=device)

  def theirs(r):
    with torch.inference_mode():
      out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=r,
                         min_new_tokens=r, pad_token_id=0)
    if on_cuda:
      torch.cuda.synchronize()
    return out

  ours = bench_generate.our_runner(config, model, prompts.tolist())
  ours(R), ours(1), theirs(R), theirs(1)
  t = bench_generate.best_times([lambda: ours(R), lambda: ours(1), lambda: theirs(R), lambda: theirs(1)],
                                cfg["repeats"])
  ours_step, theirs_step = (t[0] - t[1]) / (R - 1), (t[2] - t[3]) / (R - 1)
  return {"model": name, "batch": B, "ours_step_ms": ours_step * 1e3, "transformers_step_ms": theirs_step * 1e3,
          "speedup": theirs_step / ours_step, "torch_device": device}


def engine_section(cfg, env, args) -> dict:
  name, config, model = _decode_model(cfg, args, env)
  rows = []
  # KV block size (per-entry overheads vs partial blocks), attention form, staged slots (refills on device)
  for bs, form, staged in cfg["engine_variants"]:
    ns = argparse.Namespace(slots=cfg["engine_slots"], engine_max_new_tokens=cfg["engine_R"],
                            engine_prompts=cfg["engine_prompts"], prompt_len=cfg["prompt_len"], stop_fraction=1 / 256,
                            chunk_steps=16, repeats=1, engine_workloads=cfg["engine_workloads"], kv_block_size=bs,
                            paged_attention=form, staged_slots=staged)
    rows += [dict(r, kv_block_size=bs, paged_attention=form, staged_slots=staged)
             for r in bench_generate.engine_table(config, model, ns, name)]
  return {"model": name, "slots": ns.slots, "prompts": ns.engine_prompts, "max_new_tokens": ns.engine_max_new_tokens,
          "rows": rows}


def top_kernels(trace_dir, top: int = 20) -> dict:
  """The kernels of a JAX profiler trace (`perfetto_trace.json.gz` under `trace_dir`), by total time:
  the complete events ('X') of the device processes ('/device:GPU:0' ...); without one (a CPU run),
  the XLA executor threads' events. Returns {'total_us', 'events', 'top': [{name, count, us, share}]}."""
  import collections
  import glob
  import gzip

  files = sorted(glob.glob(os.path.join(str(trace_dir), "**", "perfetto_trace.json.gz"), recursive=True))
  if not files:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}")
  with gzip.open(files[-1]) as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  device = {pid for pid, n in names.items() if n.startswith("/device:")}
  if device:
    keep = lambda e: e["pid"] in device
  else:
    keep = lambda e: threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")
  time_by, count_by = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") == "X" and keep(e):
      time_by[e["name"]] += float(e.get("dur", 0.0))
      count_by[e["name"]] += 1
  total = sum(time_by.values())
  return {"total_us": total, "events": sum(count_by.values()), "source": "device" if device else "host threads",
          "top": [{"name": n, "count": count_by[n], "us": t, "share": t / total if total else 0.0}
                  for n, t in time_by.most_common(top)]}


def profile_section(cfg, env, args) -> dict:
  """Traces: `profile_chunks` slot-engine decode chunks with every slot busy (equal lengths, no stop
  tokens; one chunk in flight, so each step() is one whole chunk of `chunk_steps` steps), then one
  trainer step at the trainer section's shapes; the top kernels of each and kernels per decode step."""
  import jax
  import numpy as np

  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.generation.engine import SlotEngine

  name, config, model = _decode_model(cfg, args, env)
  S, P, R = cfg["engine_slots"], cfg["prompt_len"], cfg["engine_R"]
  chunks = cfg["profile_chunks"]
  steps = max(1, min(16, R // (chunks + 2)))  # every chunk runs all its steps: no row reaches R
  engine = SlotEngine(config, lanes=S, sampling=SamplingParams(temperature=1.0, max_new_tokens=R),
                      max_prompt_len=P, chunk_steps=steps, chunks_in_flight=1)
  rng = np.random.RandomState(0)
  engine.swap(engine.sampler.place_params(model), 0)
  engine.submit(rng.randint(1, config.vocab_size, (S, P)).tolist(), seed=0)
  engine.step()  # inserts every prompt, runs the first chunk (warm)
  out = Path(tempfile.mkdtemp(prefix="bench_gpu_profile_"))
  t0 = time.perf_counter()
  with bench_generate.profiled(str(out), "decode"):
    for _ in range(chunks):
      engine.step()
  wall = time.perf_counter() - t0
  decode_steps = chunks * steps
  decode = top_kernels(out / "decode")
  decode.update(steps=decode_steps, wall_ms_per_step=wall * 1e3 / decode_steps if decode_steps else None,
                kernels_per_step=decode["events"] / decode_steps if decode_steps else None,
                device_us_per_step=decode["total_us"] / decode_steps if decode_steps else None)
  weights = str(engine.sampler.layout)  # the engine's programs run the serving layout (swap fuses Q/K/V, gate/up)
  del engine
  ns = bench_train.build_parser().parse_args([])
  ns.__dict__.update(dtype=args.dtype, microbatches=cfg["microbatches"], remat=cfg["train_remat"], tp=1,
                     batch=cfg["train_B"], prompt_len=cfg["train_P"], resp_len=cfg["train_R"], warmup=1, steps=1,
                     profile=str(out))
  bench_train.bench(cfg["size"], ns, 1.0)
  train = top_kernels(out / "train_step")
  jax.clear_caches()
  return {"model": name, "slots": S, "chunk_steps": steps, "weights": weights, "decode": decode, "train": train,
          "trace_dir": str(out)}


def bytes_section(cfg, env, args) -> dict:
  """One paged decode step's bytes from XLA's cost analysis of the program compiled for this GPU
  (compile only, nothing runs), at the issue-26 configuration (64 slots, cache 2048, live lengths 100..500), per KV block size and attention form."""
  import jax
  import jax.numpy as jnp

  from llamarl_jax.model.hf import config_from_hf

  config = config_from_hf(bench_generate.hf_config(cfg["bytes_size"]).to_dict(), dtype=jnp.dtype(args.dtype))
  rows, not_counted = [], []
  for bs, form in dict.fromkeys(v[:2] for v in cfg["engine_variants"]):  # the stage does not change a step
    if form == "pallas" and jax.default_backend() != "gpu":  # interpret mode: XLA ops, not the kernel's traffic
      not_counted.append(f"KV block {bs}, {form}: the kernel's bytes are counted compiled for a GPU only "
                     f"(on {jax.default_backend()} it runs in Pallas' interpret mode)")
      continue
    ns = argparse.Namespace(slots=cfg["bytes_slots"], bytes_cache=cfg["bytes_cache"], bytes_prompt=128 if not
                            env["dry_run"] else 16, bytes_live=cfg["bytes_live"], chunk_steps=16, kv_block_size=bs,
                            bytes_target="default", paged_attention=form)
    rows += [dict(r, kv_block_size=bs, paged_attention=form)
             for r in bench_generate.bytes_table(config, ns, cfg["bytes_size"])]
  return {"model": cfg["bytes_size"], "rows": rows, "not_counted": not_counted}


def weight_push_section(cfg, env, args) -> dict:
  import jax
  import jax.numpy as jnp

  from llamarl_jax import parallel
  from llamarl_jax.executors.weight_sync import WeightSync, tree_bytes

  config = bench_weight_sync.model_config(cfg["push_size"])
  n = len(jax.devices())
  repeats = max(cfg["repeats"], 3)
  if n >= 2:  # disjoint meshes: trainer fsdp over half the devices, generator tp over the other half
    trainer_mesh, gen_mesh = parallel.make_meshes(trainer_fsdp=n // 2, generator_tp=n // 2)
    params, axes = bench_weight_sync.trainer_params(config, trainer_mesh)
    r = bench_weight_sync.bench_one(config, params, axes, trainer_mesh, gen_mesh, "fp32 -> bf16", repeats)
    layout = f"trainer fsdp{n // 2} -> generator tp{n // 2} (disjoint devices)"
  else:  # colocated: the push casts on the device; the baseline is an on-device copy of the same bytes
    mesh = parallel.make_mesh(jax.devices()[:1])
    params, axes = bench_weight_sync.trainer_params(config, mesh)
    shapes = jax.eval_shape(lambda p: p, params)
    sync = WeightSync(parallel.param_shardings(shapes, axes, mesh), dtype=jnp.bfloat16)
    sync.push(params, 0)
    push = statistics.median(sync.push(params, v + 1)["sync/seconds"] for v in range(repeats))
    moved = jax.block_until_ready(sync.wire(params)[0])
    copy_fn = jax.jit(lambda t: jax.tree.map(jnp.copy, t))
    jax.block_until_ready(copy_fn(moved))
    (copy,) = bench_generate.best_times([lambda: jax.block_until_ready(copy_fn(moved))], repeats)
    r = {"params": sum(x.size for x in jax.tree.leaves(params)), "mode": "fp32 -> bf16", "bytes": tree_bytes(moved),
         "push": push, "copy": copy}
    layout = "colocated on one device (cast in place; copy = on-device copy of the bf16 tree)"
  return {"size": cfg["push_size"], "layout": layout, "params": r["params"], "mode": r["mode"], "bytes": r["bytes"],
          "push_s": r["push"], "copy_s": r["copy"], "push_gbps": r["bytes"] / r["push"] / 1e9,
          "copy_gbps": r["bytes"] / r["copy"] / 1e9}


def train_run(gin_file: str, bindings, run_dir) -> dict:
  """`scripts/train.py`'s job (`experiment.run_experiment`) in a fresh interpreter (its own compiles and
  its own peak device memory); returns its summary with "peak_memory_bytes" (None on a CPU)."""
  import subprocess

  spec = Path(run_dir).with_suffix(".spec.json")
  out = Path(run_dir).with_suffix(".summary.json")
  spec.write_text(json.dumps({"gin_file": str(ROOT / "configs" / gin_file), "out": str(out),
                              "bindings": [*bindings, f"run_experiment.run_dir = '{run_dir}'",
                                           "run_experiment.tensorboard = False"]}))
  proc = subprocess.run([sys.executable, "-m", "scripts.bench_gpu", "--train_run", str(spec)], cwd=ROOT,
                        capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"{gin_file} exited with {proc.returncode}: {proc.stderr[-3000:]}")
  print(proc.stdout[-4000:], flush=True)  # the memory plan and the breakdown
  return json.loads(out.read_text())


def _train_run_child(spec_path: str) -> None:
  import jax

  from llamarl_jax import experiment

  spec = json.loads(Path(spec_path).read_text())
  experiment.parse_gin([spec["gin_file"]], spec["bindings"])
  summary = experiment.run_experiment()  # prints its memory plan and its time breakdown
  summary["peak_memory_bytes"] = peak_memory_bytes()
  summary["device"] = jax.devices()[0].device_kind
  summary["rows_per_step"] = experiment.configured_run_config().rollout.rows
  Path(spec["out"]).write_text(json.dumps(summary, default=str))


def e2e_section(cfg, env, args) -> dict:
  rows = []
  work = Path(tempfile.mkdtemp(prefix="bench_gpu_e2e_"))
  for name, gin_file, bindings in cfg["e2e"]:
    bindings = [*bindings, *(ONE_DEVICE if name == "tiny_cpu" else ())]
    t0 = time.perf_counter()
    summary = train_run(gin_file, bindings, work / name)
    steps = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "reward/mean" in m][1:]  # after the first (it compiles the trainer)
    rows_per_step = summary.get("rows_per_step")
    step_s = statistics.mean(m["time/step"] for m in steps) if steps else None
    tokens = sum(m["generate/response_length_mean"] for m in steps) * rows_per_step if steps else None
    b = summary["time_breakdown"]
    peak, plan = summary.get("peak_memory_bytes"), summary.get("memory_plan")
    plan_bytes = max(plan["totals"].values()) if plan else None
    rows.append({"config": gin_file, "bindings": bindings, "wall_s": time.perf_counter() - t0,
                 "rl_steps": len(steps) + 1, "step_s": step_s,
                 "gen_tokens_per_s": tokens / sum(m["time/step"] for m in steps) if steps else None,
                 "peak_memory_gib": _gib(peak), "plan_gib": _gib(plan_bytes),
                 # measured over planned (the allocator's peak; None where the backend keeps no statistics)
                 "peak_over_plan": peak / plan_bytes if peak is not None and plan_bytes else None,
                 "eval_before": summary.get("eval_before_rl"), "eval_after": summary.get("eval_after_rl"),
                 "breakdown": {k: v["seconds"] for k, v in b["parts"].items()}, "wall_run_s": b["wall_seconds"],
                 "unaccounted_s": b["unaccounted_seconds"]})
  return {"rows": rows}


RUNNERS = {"trainer": trainer_section, "torch_peer": torch_peer_section, "attention": attention_section,
           "decode": decode_section, "transformers": transformers_section, "engine": engine_section,
           "profile": profile_section,
           "bytes": bytes_section,
           "weight_push": weight_push_section, "e2e": e2e_section}


# ------------------------------------------------------------------------------------------------
# report


def _gib(nbytes):
  return None if nbytes is None else nbytes / 2**30


def _f(x, fmt):
  return "-" if x is None else format(x, fmt)


def markdown(results: dict) -> str:
  """The report: one small table per section that ran, a line for each skipped or failed one."""
  env, s = results["environment"], results["sections"]
  lines = [f"# bench_gpu: {env['device']} x{env['device_count']} ({env['backend']}), jax {env['jax']}, "
           f"{results['date']}" + (" (DRY RUN: toy sizes)" if env["dry_run"] else ""),
           f"command: `{results['command']}`; {results['total_s']:.0f} s in all", ""]

  def note(name):
    r = s.get(name, {})
    if "skipped" in r:
      return f"- {name}: skipped ({r['skipped']})"
    if "error" in r:
      return f"- {name}: FAILED ({r['error']})"
    return None

  for name in SECTIONS:
    if name not in s:
      continue
    r = s[name]
    if note(name):
      lines += [note(name), ""]
      continue
    lines.append(f"## {name} ({r['seconds']:.0f} s)")
    if name in ("trainer", "torch_peer"):
      lines += ["| B x (P+R) | microbatches | step ms | TFLOP/s | MFU | peak memory GiB |", "|---|---|---|---|---|---|",
                f"| {r['B']} x ({r['P']}+{r['R']}) | {r['mb']} | {r['step_s'] * 1e3:.1f} | {r['tflops']:.1f} | "
                f"{r['mfu']:.1%} | {_f(r['peak_memory_gib'], '.1f')} |"]
    elif name == "attention":
      sh = r["shape"]
      lines += [f"B{sh['B']} T{sh['T']} {sh['heads']}/{sh['kv_heads']} heads x {sh['head_dim']}, {sh['dtype']}, "
                "forward + backward", "| implementation | ms | TFLOP/s |", "|---|---|---|"]
      lines += [f"| {x['implementation']} | " + (f"skipped ({x['skipped']}) | |" if "skipped" in x else
                                                  f"{x['ms']:.2f} | {x['tflops']:.1f} |") for x in r["rows"]]
    elif name == "decode":
      lines += [f"{r['model']} ({r['params'] / 1e9:.2f}B), prompt {r['prompt_len']}, {r['new_tokens']} new tokens, "
                "greedy", "| weights | batch | step ms | tokens/s | HBM roofline (weights read) |", "|---|---|---|---|---|"]
      lines += [f"| {x['weights']} | {x['batch']} | {x['step_ms']:.2f} | {x['tokens_per_s']:,.0f} | "
                f"{_f(x['roofline'], '.0%')} ({_gib(x['weight_bytes']):.2f} GiB) |" for x in r["rows"]]
    elif name == "transformers":
      lines += ["| model | batch | ours step ms | transformers step ms | ours faster by |", "|---|---|---|---|---|",
                f"| {r['model']} | {r['batch']} | {r['ours_step_ms']:.2f} | {r['transformers_step_ms']:.2f} | "
                f"{r['speedup']:.2f}x |"]
    elif name == "engine":
      lines += [f"{r['model']}, {r['prompts']} prompts, {r['slots']} slots, up to {r['max_new_tokens']} new tokens",
                "| KV block | attention | staged slots | workload | length mean / max | slots / static | slot utilization (ideal) | "
                "while prompts wait (ideal) | occupancy (ideal) | chunks | static utilization | device idle | "
                "ms / decode step | warm-up s (programs) |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
      lines += [f"| {x['kv_block_size']} | {x['paged_attention']} | {x.get('staged_slots', 0)} | {x['workload']} | "
                f"{x['length_mean']:.0f} / {x['length_max']} | "
                f"{x['speedup']:.2f}x | {x['slot_utilization']:.1%} ({x['ideal_utilization']:.1%}) | "
                f"{_f(x['slot_utilization_queued'], '.1%')} ({x['ideal_utilization_queued']:.1%}) | "
                f"{_f(x.get('slot_occupancy'), '.1%')} ({_f(x.get('ideal_occupancy'), '.1%')}) | "
                f"{_f(x.get('chunks_per_run'), '.0f')} | {x['static_utilization']:.1%} | {x['device_idle_fraction']:.1%} | "
                f"{_f(x.get('ms_per_decode_step'), '.2f')} | {_f(x.get('warmup_s'), '.1f')} ({x.get('programs', '-')}) |"
                for x in r["rows"]]
    elif name == "profile":
      d = r["decode"]
      lines.append(f"{r['model']}, slot engine with {r['slots']} busy slots, {d['steps']} decode steps traced: "
                   f"{_f(d['kernels_per_step'], '.0f')} kernels and {_f(d['device_us_per_step'], '.0f')} us of "
                   f"{d['source']} time per step ({_f(d['wall_ms_per_step'], '.2f')} ms wall); weights "
                   f"{r.get('weights', '-')}")
      for part in ("decode", "train"):
        t = r[part]
        lines += ["", f"{part}: top kernels by time ({t['total_us'] / 1e3:.1f} ms in {t['events']} events)",
                  "| kernel | count | total us | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['count']} | {k['us']:.0f} | {k['share']:.1%} |" for k in t["top"]]
    elif name == "bytes":
      lines += [f"{r['model']}, one paged decode step, XLA's cost analysis of the program compiled for this GPU "
                "(+ the Pallas kernel's reads counted from its structure)", "| KV block | attention | layout | entries | bytes | ideal | bytes / ideal |",
                "|---|---|---|---|---|---|---|"]
      lines += [f"| {x['kv_block_size']} | {x['paged_attention']} | {x['layout']} | {x['num_entries'] or '-'} | {x['bytes'] / 1e9:.3f} GB | "
                f"{x['ideal'] / 1e9:.3f} GB | {x['ratio']:.2f}x |" for x in r["rows"]]
      lines += [f"- not counted: {x}" for x in r.get("not_counted", [])]
    elif name == "weight_push":
      lines += [r["layout"], "| params | mode | bytes | push GB/s | copy GB/s | push / copy time |",
                "|---|---|---|---|---|---|",
                f"| {r['params'] / 1e9:.2f}B | {r['mode']} | {r['bytes'] / 1e9:.2f} GB | {r['push_gbps']:.1f} | "
                f"{r['copy_gbps']:.1f} | {r['push_s'] / r['copy_s']:.1f}x |"]
    elif name == "e2e":
      lines += ["whole runs in fresh processes (`scripts/train.py`'s job); s / step and tokens/s over the steps after "
                "the first", "| config | RL steps | s / step | generated tokens/s | peak memory GiB (plan) | peak / plan | held-out "
                "before -> after | run s |", "|---|---|---|---|---|---|---|---|"]
      lines += [f"| {x['config']} | {x['rl_steps']} | {_f(x['step_s'], '.2f')} | {_f(x['gen_tokens_per_s'], ',.0f')} | "
                f"{_f(x['peak_memory_gib'], '.1f')} ({_f(x['plan_gib'], '.1f')}) | {_f(x['peak_over_plan'], '.2f')} | "
                f"{_f(x['eval_before'], '.1%')} -> "
                f"{_f(x['eval_after'], '.1%')} | {x['wall_run_s']:.0f} |" for x in r["rows"]]
      for x in r["rows"]:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in x["breakdown"].items() if v >= 0.05)
        lines.append(f"- {x['config']} seconds: {parts}; unaccounted {x['unaccounted_s']:.1f}")
    lines.append("")
  return "\n".join(lines)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="results/bench_gpu", help="directory for bench_gpu.md and bench_gpu.json")
  parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, from {SECTIONS}")
  parser.add_argument("--dry_run", action="store_true", help="toy sizes on any backend (tests the script)")
  parser.add_argument("--fp8_lm_head", action="store_true", help="decode: the fp8 rows' lm_head in fp8 too")
  parser.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16; float32 with --dry_run)")
  parser.add_argument("--peak_tflops", type=float, default=None, help="override the device's dense bf16 peak")
  parser.add_argument("--peak_bandwidth", type=float, default=None, help="override the device's HBM bytes/s")
  parser.add_argument("--train_run", default=None, help=argparse.SUPPRESS)  # the e2e section's child process
  args = parser.parse_args(argv)
  if args.train_run:
    return _train_run_child(args.train_run)
  sections = args.sections.split(",")
  unknown = [s for s in sections if s not in SECTIONS]
  if unknown:
    parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
  env = check_environment(args.dry_run)
  args.dtype = args.dtype or ("float32" if args.dry_run else "bfloat16")
  cfg = DRY if args.dry_run else FULL
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python -m scripts.bench_gpu " + " ".join(argv if argv is not None else sys.argv[1:])
  results = {"date": datetime.date.today().isoformat(), "command": command.strip(), "environment": env,
             "sections": {}, "total_s": 0.0}
  print(f"bench_gpu: {env['device']} ({env['backend']}), sections {sections}", flush=True)
  start = time.perf_counter()
  for name in sections:
    t0 = time.perf_counter()
    try:
      r = RUNNERS[name](cfg, env, args)
    except SkipSection as e:
      r = {"skipped": str(e)}
    except Exception as e:  # a failed section is reported; the others still run
      traceback.print_exc()
      r = {"error": f"{type(e).__name__}: {e}"}
    r["seconds"] = time.perf_counter() - t0
    results["sections"][name] = r
    results["total_s"] = time.perf_counter() - start
    print(f"  {name}: {r['seconds']:.0f} s" + (f" ({r.get('skipped') or r.get('error')})"
                                              if "skipped" in r or "error" in r else ""), flush=True)
    (out / "bench_gpu.json").write_text(json.dumps(results, indent=1))  # after every section: partial runs count
  report = markdown(results)
  (out / "bench_gpu.md").write_text(report)
  print("\n" + report)
  failed = [n for n, r in results["sections"].items() if "error" in r]
  if failed:
    raise SystemExit(f"bench_gpu: sections {failed} failed (see above); the others are in {out}")
  return results


if __name__ == "__main__":
  main()
