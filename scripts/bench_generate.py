#!/usr/bin/env python
"""Generation throughput: our JAX sampler vs `transformers.generate` (PyTorch), greedy, same weights.

For each model size a random `transformers.LlamaForCausalLM` is saved to a temp dir; we load that
directory with `load_hf_checkpoint`, so both sides run identical weights, batch, prompt and token
count (greedy, no stop token: every row generates exactly max_new_tokens). Our timing excludes
compilation (one warm-up call first) and ends with `block_until_ready`; each side reports its best
of --repeats. On a GPU (auto-detected) the PyTorch side is skipped (CPU-only torch) and we report
tokens/s and the fraction of the memory-bandwidth roofline reached in decode:
  bytes per decode step = parameters read (all but the embedding table, which is only gathered)
                          + KV cache of the valid positions (mean over the response)
  roofline fraction     = bytes per step / decode step time / --peak_bandwidth
Decode step time = (time(R tokens) - time(1 token)) / (R - 1), which removes prefill.

  python scripts/bench_generate.py                      # CPU: 5m and 50m vs transformers
  python scripts/bench_generate.py --sizes 50m,1b       # on a GPU

Slot engine vs static sampler (`--engine_workloads longtail,equal`, on the first size; `none` skips):
the same random weights, prompts and seeds go through `Sampler.generate` in static batches of
`--slots` rows and through a `SlotEngine` with `--slots` KV slots (every batch submitted with the seed
the static call used, so both sample the same tokens: the table reports the agreement). Sampling at
temperature 1 over the full vocabulary.
  longtail: a stop set of `--stop_fraction` of the vocabulary (random ids). The random model's
            next-token distribution is close to uniform over a wide band, so each step stops a row
            with probability about stop_fraction: response lengths are roughly geometric (mean about
            1 / stop_fraction), capped at --engine_max_new_tokens. The static batch decodes until its
            longest row stops; the slots refill as rows stop. Measured lengths are printed (max/mean).
  equal:    no stop token: every response is --engine_max_new_tokens long (the engine's overhead case).
Useful tokens/s = response tokens (stop token included, nothing after it) / wall time; best of
--repeats, alternating the two. Slot utilization = real tokens / rows the decode steps computed (a
chunk computes the smallest of the engine's decode widths that holds its busy slots: the batch
shrinks in the final drain; `--min_decode_width`), over the whole run and over the chunks dispatched
while prompts waited for slots (a stream's steady state: the generator draws the next batch before
the slots drain); occupancy = real tokens / (decode steps x slots), as if the batch never shrank;
next to each, in parentheses, an ideal scheduler's on the same lengths (every freed slot refilled
at the next step, the width chosen from the exact busy count, no host time; `ideal_utilization`):
the whole-run occupancy includes the final drain, which no scheduler avoids.
Device idle: the engine's `time/generate_device_idle` (an upper bound on the time the device waited
for the host between chunks) over the slot engine's wall time.

--profile DIR: a JAX profiler trace of the timed calls (after warm-up, so no compilation), one run
per table: DIR/generate_<size> (ours, and transformers on the host) and DIR/engine_<workload>
(static sampler and slot engine). Each call is a named span (`ours R=128`, `static`, `slots`, ...).
Open with TensorBoard's profile plugin or XProf (`pip install tensorboard-plugin-profile`, then
`tensorboard --logdir DIR`, Profile tab), or drop a run's `plugins/profile/*/perfetto_trace.json.gz`
on https://ui.perfetto.dev.
  python scripts/bench_generate.py --sizes 5m --skip_hf --repeats 2 --profile /tmp/gen_trace

--bytes: one decode step's bytes, on any backend, nothing allocated (lowered and compiled from
abstract shapes): the slot engine's paged step and the dense layout it replaced (a [slots, cache]
cache per layer, attention over all of it), from XLA's cost analysis, next to the ideal = weights
read (every matrix and the lm_head; the embedding table is only gathered) + each row's live KV.
Rows get live lengths uniform in --bytes_live (prompt part up to --bytes_prompt) in a cache of
--bytes_cache positions. "xla" is XLA's count as is; "bytes" charges a fused gather what it reads and
an in-place scatter what it updates, not their whole operand (the generic cost analysis charges a
fusion's gathered or scattered-into operand in full: the whole KV pool per layer;
`hlo.fused_index_overcount`). A "floor" row runs the same step over a dense cache of 3 positions
per row (everything but the attention's KV reads), so (bytes - floor) / live KV is the attention's
cost per byte of live KV. Kernels: the compiled step's kernel launches (`hlo.kernel_counts`), with
the generator's weights in the serving layout (Q/K/V and gate/up fused; `--weight_layout hf`: the
trainer's). No timing is run.
--bytes_target h100: the same programs compiled by XLA's GPU compiler for an H100 (target description
in scripts/gpu_targets/), with no GPU attached: the optimized module (the GPU's fusions, i.e. its
kernels) under XLA's generic cost analysis. Needs JAX's CUDA plugin (see `CUDA_PLUGIN_HELP`); no
autotuning runs without the device, so the GEMM configurations are the compiler's defaults.
  python scripts/bench_generate.py --bytes --sizes 1b --slots 64 --bytes_cache 2048 --dtype float32
  python scripts/bench_generate.py --bytes --bytes_target h100 --sizes 1b --slots 64   # bf16
"""

import argparse
import contextlib
import dataclasses
import os
import platform
import tempfile
import time
from pathlib import Path


# name: (vocab, hidden, intermediate, layers, heads, kv_heads)
SIZES = {
    "5m": (4096, 256, 688, 4, 4, 2),
    "50m": (32000, 512, 1376, 8, 8, 4),
    "400m": (32000, 1024, 2816, 24, 16, 8),
    "1b": (128256, 2048, 8192, 16, 32, 8),  # Llama 3.2 1B shapes
    "8b": (128256, 4096, 14336, 32, 32, 8),  # Llama 3.1 8B shapes
}


# --bytes_target: XLA GPU target descriptions (scripts/gpu_targets/) a program can be compiled for
# without the GPU
GPU_TARGETS = {"h100": "h100_sxm.pbtxt"}

CUDA_PLUGIN_HELP = """compiling for a GPU target without a GPU needs JAX's CUDA plugin and ptxas next to this jax:
  v=$(python -c "import jaxlib; print(jaxlib.__version__)")
  pip install --no-deps --target /tmp/cudasite "jax-cuda12-plugin==$v" "jax-cuda12-pjrt==$v" nvidia-cuda-nvcc-cu12
  JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=/tmp/cudasite \\
    PATH=/tmp/cudasite/nvidia/cuda_nvcc/bin:$PATH python scripts/bench_generate.py --bytes --bytes_target h100 ..."""


def target_mesh(target):
  """The generator mesh of one device to compile the --bytes step for: this backend's first device,
  or (a GPU target) a device of `target_devices`."""
  import jax

  from llamarl_jax import parallel

  if target == "default":
    return parallel.make_mesh(jax.devices()[:1])
  return parallel.make_mesh(target_devices(target, 1))


def target_devices(target, n):
  """`n` devices of one node of a GPU target: a `jax.experimental.topologies` topology built from its
  target description, which XLA's GPU compiler compiles for with no GPU attached (nothing can run on it)."""
  from jax.experimental import topologies

  text = (Path(__file__).resolve().parent / "gpu_targets" / GPU_TARGETS[target]).read_text()
  try:
    topology = topologies.get_topology_desc(target, "cuda", target_config=text, topology=f"1x1x{n}")
  except Exception as e:  # no CUDA plugin: "topology not implemented for cuda", or its import errors
    raise SystemExit(f"compiling for {target} ({n} devices): {type(e).__name__}: {e}\n{CUDA_PLUGIN_HELP}") from e
  return list(topology.devices)


def hf_config(name):
  import transformers

  vocab, d, f, layers, heads, kv = SIZES[name]
  return transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                                  rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=0)


def best_times(fns, repeats, names=None):
  """Best wall time of each callable, alternating them so background load hits all alike.

  names: a label per callable, each call then a named span in a profiler trace (see `profiled`)."""
  times = [[] for _ in fns]
  spans = [contextlib.nullcontext] * len(fns)
  if names is not None:
    import jax

    spans = [lambda n=n: jax.profiler.TraceAnnotation(n) for n in names]
  for _ in range(repeats):
    for fn, ts, span in zip(fns, times, spans):
      with span():
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
  return [min(ts) for ts in times]


def profiled(profile_dir, run):
  """A JAX profiler trace of the block into `profile_dir/run` (a no-op when profile_dir is None)."""
  if profile_dir is None:
    return contextlib.nullcontext()
  import jax

  return jax.profiler.trace(os.path.join(profile_dir, run), create_perfetto_trace=True)


def cpu_model():
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def our_runner(config, model, prompts, quantize=None):
  """run(max_new_tokens) -> RolloutBatch, greedy, blocking; params placed once up front (quantize='fp8':
  quantised there too; 'fp8+lm_head': the lm_head too). The runner's `weight_bytes`: what a decode
  step reads of them (not the embedding)."""
  import jax

  from llamarl_jax.generation import Sampler, SamplingParams

  sampler = Sampler(config, quantize=quantize)
  params = sampler.place_params(model)  # the timed calls see resident weights, as the generator does
  run = lambda r: jax.block_until_ready(sampler.generate(params, prompts, SamplingParams(temperature=0, max_new_tokens=r)))
  run.weight_bytes = sum(x.nbytes for k, v in params.items() if k != "embed" for x in jax.tree.leaves(v))
  return run


def hf_runner(ref, prompts, max_new_tokens):
  import torch

  ids = torch.tensor(prompts)
  kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, pad_token_id=0)

  def run():
    with torch.inference_mode():
      return ref.generate(ids, **kw)[:, ids.shape[1]:].numpy()
  return run


def decode_roofline(config, batch, prompt_len, max_new_tokens, step_s, dtype_bytes, peak, weight_bytes=None):
  """Fraction of peak bandwidth: (weights + mean valid KV) bytes per decode step / step time / peak
  (weight_bytes: the weights as held, e.g. fp8; default every parameter but the embedding in dtype_bytes)."""
  c = config
  weights = (c.num_params() - c.vocab_size * c.hidden_size) * dtype_bytes  # the embedding is only gathered
  weights = weights if weight_bytes is None else weight_bytes
  kv = 2 * c.num_layers * batch * (prompt_len + max_new_tokens / 2) * c.num_kv_heads * c.head_dim * dtype_bytes
  return (weights + kv) / step_s / peak


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", default="5m,50m", help=f"comma-separated from {sorted(SIZES)}")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt_len", type=int, default=32)
  parser.add_argument("--max_new_tokens", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
  parser.add_argument("--dtype", default=None, help="params/compute dtype (default: float32 on CPU, bfloat16 on GPU)")
  parser.add_argument("--peak_bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM: 3.35e12)")
  parser.add_argument("--skip_hf", action="store_true", help="do not run transformers")
  parser.add_argument("--engine_workloads", default="longtail,equal",
                      help="slot engine vs static sampler workloads: longtail, equal (or none)")
  parser.add_argument("--slots", type=int, default=16, help="engine slots = static batch rows")
  parser.add_argument("--engine_prompts", type=int, default=128)
  parser.add_argument("--engine_max_new_tokens", type=int, default=256)
  parser.add_argument("--stop_fraction", type=float, default=1 / 32)
  parser.add_argument("--chunk_steps", type=int, default=16)
  parser.add_argument("--profile", metavar="DIR", default=None,
                      help="write a JAX profiler trace of the timed calls under DIR (see above)")
  parser.add_argument("--bytes", action="store_true",
                      help="one decode step's bytes (XLA cost analysis) vs the ideal, paged and dense (see above)")
  parser.add_argument("--bytes_cache", type=int, default=2048, help="--bytes: cache positions per slot")
  parser.add_argument("--bytes_prompt", type=int, default=128, help="--bytes: the longest prompt")
  parser.add_argument("--bytes_live", default="100,500", help="--bytes: live lengths uniform in lo,hi")
  parser.add_argument("--bytes_target", default="default", choices=["default", *sorted(GPU_TARGETS)],
                      help="--bytes: compile for this backend's first device (default), or for a GPU target "
                           "without one (needs the CUDA plugin: see the module docstring)")
  parser.add_argument("--quantize", default=None, choices=["fp8"],
                      help="--bytes: the generator's weights in fp8 (float8_e4m3fn projections, fp8 GEMMs)")
  parser.add_argument("--weight_layout", default="serving", choices=["serving", "hf"],
                      help="--bytes: the generator's weights fused (serving: Q/K/V, gate/up) or the trainer's layout")
  parser.add_argument("--kv_block_size", type=int, default=16, help="slot engine KV block (positions)")
  parser.add_argument("--staged_slots", type=int, default=0,
                      help="slot engine: KV slots beyond --slots, prefilled ahead and admitted on device")
  parser.add_argument("--min_decode_width", type=int, default=None,
                      help="slot engine: fewest rows a decode chunk computes (default slots / 16; = --slots: "
                           "the batch never shrinks)")
  parser.add_argument("--paged_attention", default="auto", choices=["auto", "reduce", "dot", "pallas", "pallas_fused"],
                      help="slot engine: the decode attention's form (pallas: one kernel, paged_kernel.py)")
  args = parser.parse_args(argv)
  if args.device == "cpu":
    os.environ["JAX_PLATFORMS"] = "cpu"

  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax.model import init_model, load_hf_checkpoint
  from llamarl_jax.model.hf import config_from_hf

  on_gpu = jax.default_backend() == "gpu"
  if args.device == "gpu" and not on_gpu:
    parser.error(f"--device gpu but JAX's backend is {jax.default_backend()}")
  args.roofline = on_gpu
  dtype = jnp.dtype(args.dtype or ("bfloat16" if on_gpu else "float32"))
  if args.bytes:  # cost analysis only: no weights, no timing
    mesh = target_mesh(args.bytes_target)
    if args.bytes_target != "default":
      dtype = jnp.dtype(args.dtype or "bfloat16")
    return [row for name in args.sizes.split(",")
            for row in bytes_table(config_from_hf(hf_config(name).to_dict(), dtype=dtype), args, name, mesh)]
  run_hf = not (on_gpu or args.skip_hf)
  if run_hf and dtype != jnp.float32:
    parser.error("the transformers comparison runs in float32; pass --dtype float32 or --skip_hf")

  print(f"# generate benchmark: batch {args.batch}, prompt {args.prompt_len}, {args.max_new_tokens} new tokens, "
        f"greedy, {dtype.name}, best of {args.repeats}")
  print(f"# {time.strftime('%Y-%m-%d')}; jax {jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}); host: {os.cpu_count()} CPUs, {cpu_model()}")
  header = "| model | params | ours tok/s |"
  header += " transformers tok/s | ratio |" if run_hf else ""
  header += " decode step ms | roofline |" if args.roofline else ""
  print(header)
  print("|" + "---|" * (header.count("|") - 1))
  rng = np.random.RandomState(0)
  for name in args.sizes.split(","):
    cfg = hf_config(name)
    prompts = rng.randint(1, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()
    if run_hf:
      import torch
      import transformers

      transformers.utils.logging.disable_progress_bar()
      torch.manual_seed(0)
      ref = transformers.LlamaForCausalLM(cfg).eval()
      with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        config, model = load_hf_checkpoint(tmp, dtype=dtype)
    else:
      config = config_from_hf(cfg.to_dict(), dtype=dtype)
      model = init_model(config, seed=0)
    ours = our_runner(config, model, prompts)
    R, n_tokens = args.max_new_tokens, args.batch * args.max_new_tokens
    our_tokens = np.asarray(ours(R).response_tokens)  # compile + warm up
    fns, names = [lambda: ours(R)], [f"ours R={R}"]
    if run_hf:
      theirs = hf_runner(ref, prompts, R)
      their_tokens = theirs()  # warm up
      fns.append(theirs)
      names.append(f"transformers R={R}")
    if args.roofline:
      ours(1)  # prefill + one token: subtracted to isolate decode
      fns.append(lambda: ours(1))
      names.append("ours R=1")
    with profiled(args.profile, f"generate_{name}"):
      times = best_times(fns, args.repeats, names)
    row = f"| {name} | {config.num_params() / 1e6:.1f}M | {n_tokens / times[0]:,.0f} |"
    if run_hf:
      row += f" {n_tokens / times[1]:,.0f} | {times[1] / times[0]:.2f}x |"
      same = float(np.mean(our_tokens == their_tokens))
      if same < 1:
        row += f" (greedy tokens agree {same:.1%})"
    if args.roofline:
      step = (times[0] - times[-1]) / (R - 1)
      frac = decode_roofline(config, args.batch, args.prompt_len, R, step, dtype.itemsize, args.peak_bandwidth)
      row += f" {step * 1e3:.2f} | {frac:.0%} |"
    print(row, flush=True)
  if args.engine_workloads != "none":
    name = args.sizes.split(",")[0]
    config = config_from_hf(hf_config(name).to_dict(), dtype=dtype)
    engine_table(config, init_model(config, seed=0), args, name)


def _pct(x):
  return "-" if x is None else f"{x:.1%}"


def _gb(n):
  return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def bytes_table(config, args, name, mesh=None):
  """One decode step's bytes (XLA cost analysis, abstract shapes) vs the ideal, for the slot engine's
  paged layout and the dense one, compiled for `mesh`'s devices (default: this backend's first);
  prints a table and returns its rows as dicts. A third row, the floor, is the same step over a dense
  cache of 3 positions per row: the bytes of everything but the attention's KV (weights' kernels,
  norms, sampling), so (bytes - floor) / live KV is what the attention moves per byte of live KV."""
  import jax
  import numpy as np

  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.slot_programs import SlotPrograms
  from llamarl_jax.measure.decode_cost import decode_step_cost

  S, T, Pm = args.slots, args.bytes_cache, args.bytes_prompt
  lo, hi = (int(x) for x in args.bytes_live.split(","))
  if not 2 <= lo <= hi <= T or not 1 <= Pm < T:
    raise SystemExit(f"need 2 <= lo <= hi <= --bytes_cache ({T}) and 1 <= --bytes_prompt < --bytes_cache; "
                     f"got --bytes_live {lo},{hi}, --bytes_prompt {Pm}")
  rng = np.random.RandomState(0)
  live = rng.randint(lo, hi + 1, S)
  prompt = np.minimum(rng.randint(max(1, Pm // 4), Pm + 1, S), live - 1)
  sampling = SamplingParams(temperature=0, max_new_tokens=T - Pm)
  from llamarl_jax.model.config import HF_LAYOUT
  weights = HF_LAYOUT if getattr(args, "weight_layout", "serving") == "hf" else None  # None: the serving layout
  quantize = getattr(args, "quantize", None)
  sampler = Sampler(config, mesh, layout=weights, quantize=quantize)
  programs = SlotPrograms(config, sampler, num_slots=S, sampling=sampling, max_prompt_len=Pm,
                          chunk_steps=args.chunk_steps, pad_id=0, kv_block_size=args.kv_block_size,
                          paged_attention=getattr(args, "paged_attention", "auto"))
  dtype = jax.numpy.dtype(config.dtype).name
  device = programs.mesh.devices.flat[0]
  print(f"\n# one decode step's bytes: {name} {dtype}{' weights fp8' if quantize else ''}, {S} slots, cache {T} (prompt <= {Pm}), live lengths "
        f"{lo}..{hi} (mean {live.mean():.0f}), KV blocks of {args.kv_block_size}, paged attention "
        f"{getattr(args, 'paged_attention', 'auto')}; XLA cost analysis of the program "
        f"compiled for {device.device_kind} ({device.platform}{', no device attached' if args.bytes_target != 'default' else ''}), "
        f"jax {jax.__version__}")
  print(f"# weights: {sampler.layout}; "
        "kernels: launches of the compiled step (hlo.kernel_counts; meaningful for a GPU target)")
  print("| layout | entries | bytes/step | xla (as is) | ideal (weights + live KV) | layers' weights | bytes / ideal | "
        "(bytes - floor) / live KV | kernels (GEMMs) |")
  print("|---|---|---|---|---|---|---|---|---|")
  ones = np.ones(S, np.int64)
  # the same step over a dense cache of 3 positions per row: its weights' kernels, norms and sampling
  tiny = SlotPrograms(config, Sampler(config, mesh, layout=weights, quantize=quantize), num_slots=S, sampling=dataclasses.replace(sampling, max_new_tokens=2),
                      max_prompt_len=1, chunk_steps=args.chunk_steps, pad_id=0, kv_block_size=args.kv_block_size)
  floor = decode_step_cost(tiny, ones, ones, layout="dense")
  rows = []
  for layout, p, m in (("paged", prompt, live - prompt), ("dense", prompt, live - prompt),
                       ("floor: the step over 3 cached positions per row", ones, ones)):
    c = floor if m is ones else decode_step_cost(programs, p, m, layout=layout)
    attn = "-" if m is ones else f"{(c['bytes'] - floor['bytes']) / c['kv']:.2f}x"
    print(f"| {layout} | {c['num_entries'] or '-'} | {_gb(c['bytes'])} | {_gb(c['xla_bytes'])} | "
          f"{_gb(c['ideal'])} ({_gb(c['weights'])} + {_gb(c['kv'])}) | {_gb(c['layer_weights'])} | {c['ratio']:.2f}x | {attn} | "
          f"{c['kernels']['total']} ({c['kernels']['gemm']}) |", flush=True)
    rows.append(dict(c, layout=layout.split(":")[0], size=name, dtype=dtype, quantize=quantize, live_mean=float(live.mean()),
                     target=args.bytes_target, floor_bytes=floor["bytes"]))
  return rows


def ideal_utilization(lengths, num_slots, n=1, widths=None):
  """Slot utilization of an ideal scheduler on these response lengths: every freed slot refilled at
  the very next step (FIFO, a group of n consecutive lengths admitted when n slots are free), no host
  time. A response of l tokens holds its slot for l - 1 decode steps (the first token comes from the
  prefill). Utilization = busy rows / rows computed; each step computes the smallest of `widths`
  (default: only num_slots) that holds the busy slots, as the engine's chunks do
  (`SlotPrograms.widths`). Returns (utilization, utilization while prompts wait): the first includes
  the final drain (the last rows finishing alone), which no scheduler avoids on a finite batch; a
  shrinking batch computes fewer idle rows there."""
  import numpy as np

  widths = sorted(widths or (num_slots,))
  need = np.maximum(np.asarray(lengths, np.int64) - 1, 0).reshape(-1, n)
  left = np.zeros(num_slots, np.int64)  # decode steps each slot still holds its row for
  head, rows, useful, q_rows, q_useful = 0, 0, 0, 0, 0
  while head < len(need) or left.any():
    while head < len(need) and np.sum(left == 0) >= n:
      free = np.flatnonzero(left == 0)[:n]
      left[free] = need[head]
      head += 1
    busy = int(np.sum(left > 0))
    if busy == 0:
      continue
    width = next(w for w in widths if w >= busy)
    rows, useful = rows + width, useful + busy
    if head < len(need):
      q_rows, q_useful = q_rows + width, q_useful + busy
    left = np.maximum(left - 1, 0)
  return useful / max(rows, 1), q_useful / max(q_rows, 1)


def engine_table(config, model, args, name):
  """Slot engine vs static sampler on the same weights, prompts and seeds; prints one row per workload
  and returns them as dicts."""
  import jax
  import numpy as np

  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.engine import SlotEngine

  S, R, N = args.slots, args.engine_max_new_tokens, args.engine_prompts
  rng = np.random.RandomState(1)
  prompts = rng.randint(1, config.vocab_size, (N, args.prompt_len)).tolist()
  batches = [prompts[i:i + S] for i in range(0, N, S)]
  print(f"\n# slot engine vs static sampler: {name}, {N} prompts of {args.prompt_len}, {S} slots = static batch, "
        f"max {R} new tokens, temperature 1, chunk {args.chunk_steps} steps, KV blocks of "
        f"{getattr(args, 'kv_block_size', 16)}, best of {args.repeats}")
  print("| workload | lengths mean / max (max/mean) | static tok/s | slots tok/s | slots / static | "
        "slot utilization (ideal) | while prompts wait (ideal) | occupancy (ideal) | decode rows mean | chunks / run | "
        "static utilization | device idle | same tokens |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for workload in args.engine_workloads.split(","):
    if workload not in ("longtail", "equal"):
      raise SystemExit(f"unknown engine workload {workload!r}; expected longtail or equal")
    stops = ()
    if workload == "longtail":
      count = max(1, round(args.stop_fraction * config.vocab_size))
      stops = tuple(int(t) for t in rng.choice(np.arange(1, config.vocab_size), count, replace=False))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=R, stop_token_ids=stops)
    sampler = Sampler(config)
    engine = SlotEngine(config, lanes=S, sampling=sampling, max_prompt_len=args.prompt_len,
                        chunk_steps=args.chunk_steps, kv_block_size=getattr(args, "kv_block_size", 16),
                        paged_attention=getattr(args, "paged_attention", "auto"),
                        min_decode_width=getattr(args, "min_decode_width", None),
                        staged_slots=getattr(args, "staged_slots", 0))
    params = sampler.place_params(model)

    def static():
      out = [sampler.generate(params, b, dataclasses.replace(sampling, seed=i)) for i, b in enumerate(batches)]
      return jax.device_get([(o.response_tokens, o.lengths) for o in out])

    def slots():
      t0 = time.perf_counter()
      try:
        return run_slots()
      finally:
        slot_wall[0] += time.perf_counter() - t0

    slot_wall = [0.0]

    def run_slots():
      engine.swap(params, 0)
      for i, b in enumerate(batches):
        engine.submit(b, seed=i, tags=[(i, j) for j in range(len(b))])
      groups = sorted(engine.run(), key=lambda g: g.tag)
      return [(np.concatenate([g.tokens for g in groups[i * S:(i + 1) * S]]),
               np.concatenate([g.lengths for g in groups[i * S:(i + 1) * S]])) for i in range(len(batches))]

    ref, got = static(), slots()  # compile + warm up
    lengths = np.concatenate([l for _, l in ref])
    same = np.mean([np.array_equal(a[0], b[0]) for a, b in zip(ref, got)] + [
        np.array_equal(a[1], b[1]) for a, b in zip(ref, got)])
    static_steps = sum(int(l.max()) - 1 for _, l in ref)
    engine.take_metrics()
    slot_wall[0] = 0.0
    with profiled(getattr(args, "profile", None), f"engine_{workload}"):
      t_static, t_slots = best_times([static, slots], args.repeats, ["static", "slots"])
    m = engine.take_metrics()
    util, util_q = m["generate/slot_utilization"], m["generate/slot_utilization_queued"]
    if not m["generate/decode_steps_queued"]:  # prompts never waited (e.g. all of them staged at once)
      util_q = None
    idle = m["time/generate_device_idle"] / max(slot_wall[0], 1e-9)  # an upper bound (see take_metrics)
    # submit order = prompt order (FIFO), n = 1; the engine's decode widths, and every slot (occupancy)
    ideal, ideal_q = ideal_utilization(lengths, S, widths=engine.programs.widths)
    ideal_occupancy = ideal_utilization(lengths, S)[0]
    occupancy, rows_mean = m["generate/slot_occupancy"], m["generate/decode_width_mean"]
    chunks = m["generate/chunks"] / args.repeats  # host round trips per run (each a harvest)
    useful = float(lengths.sum())
    print(f"| {workload} | {lengths.mean():.1f} / {lengths.max()} ({lengths.max() / lengths.mean():.1f}) | "
          f"{useful / t_static:,.0f} | {useful / t_slots:,.0f} | {t_static / t_slots:.2f}x | {util:.1%} ({ideal:.1%}) | "
          f"{_pct(util_q)} ({ideal_q:.1%}) | {occupancy:.1%} ({ideal_occupancy:.1%}) | {rows_mean:.1f} | {chunks:.0f} | "
          f"{(useful - N) / (static_steps * S):.1%} | {idle:.1%} | {same:.0%} |",
          flush=True)
    rows.append({"workload": workload, "length_mean": float(lengths.mean()), "length_max": int(lengths.max()),
                 "static_tokens_per_s": useful / t_static, "slots_tokens_per_s": useful / t_slots,
                 "speedup": t_static / t_slots, "slot_utilization": float(util),
                 "ideal_utilization": ideal, "device_idle_fraction": idle,
                 "slot_utilization_queued": None if util_q is None else float(util_q), "ideal_utilization_queued": ideal_q,
                 "slot_occupancy": float(occupancy), "ideal_occupancy": ideal_occupancy,
                 "decode_rows_mean": float(rows_mean), "chunks_per_run": float(chunks),
                 "static_utilization": (useful - N) / (static_steps * S), "same_tokens": float(same),
                 # the engine's construction: its program set compiled (or loaded from the persistent cache)
                 "warmup_s": engine.warmup_s, "programs": engine.programs.num_compiled,
                 "ms_per_decode_step": t_slots * 1e3 * args.repeats / max(m["generate/decode_steps"], 1)})
  return rows


if __name__ == "__main__":
  main()
