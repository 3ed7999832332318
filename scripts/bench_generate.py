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
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name: (vocab, hidden, intermediate, layers, heads, kv_heads)
SIZES = {
    "5m": (4096, 256, 688, 4, 4, 2),
    "50m": (32000, 512, 1376, 8, 8, 4),
    "400m": (32000, 1024, 2816, 24, 16, 8),
    "1b": (128256, 2048, 8192, 16, 32, 8),  # Llama 3.2 1B shapes
}


def hf_config(name):
  import transformers

  vocab, d, f, layers, heads, kv = SIZES[name]
  return transformers.LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                                  rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=None,
                                  bos_token_id=None, pad_token_id=0)


def best_times(fns, repeats):
  """Best wall time of each callable, alternating them so background load hits all alike."""
  times = [[] for _ in fns]
  for _ in range(repeats):
    for fn, ts in zip(fns, times):
      t = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t)
  return [min(ts) for ts in times]


def cpu_model():
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def our_runner(config, model, prompts):
  """run(max_new_tokens) -> RolloutBatch, greedy, blocking; params placed once up front."""
  import jax

  from llamarl_jax.generation import Sampler, SamplingParams

  sampler = Sampler(config)
  params = sampler.place_params(model)  # the timed calls see resident weights, as the generator does
  return lambda r: jax.block_until_ready(sampler.generate(params, prompts, SamplingParams(temperature=0, max_new_tokens=r)))


def hf_runner(ref, prompts, max_new_tokens):
  import torch

  ids = torch.tensor(prompts)
  kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, pad_token_id=0)

  def run():
    with torch.inference_mode():
      return ref.generate(ids, **kw)[:, ids.shape[1]:].numpy()
  return run


def decode_roofline(config, batch, prompt_len, max_new_tokens, step_s, dtype_bytes, peak):
  """Fraction of peak bandwidth: (weights + mean valid KV) bytes per decode step / step time / peak."""
  c = config
  weights = (c.num_params() - c.vocab_size * c.hidden_size) * dtype_bytes  # the embedding is only gathered
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
    fns = [lambda: ours(R)]
    if run_hf:
      theirs = hf_runner(ref, prompts, R)
      their_tokens = theirs()  # warm up
      fns.append(theirs)
    if args.roofline:
      ours(1)  # prefill + one token: subtracted to isolate decode
      fns.append(lambda: ours(1))
    times = best_times(fns, args.repeats)
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


if __name__ == "__main__":
  main()
