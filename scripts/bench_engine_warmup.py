#!/usr/bin/env python
"""The slot engine's warm-up: seconds from `SlotEngine(...)` to an engine ready to decode (its whole
program set compiled, or loaded from JAX's persistent compilation cache), per program, in this
process. Run it twice in fresh processes to see a cold and a warm cache:

  LLAMARL_JAX_CACHE_DIR=/tmp/jaxcache python -m scripts.bench_engine_warmup --size 1b   # cold
  LLAMARL_JAX_CACHE_DIR=/tmp/jaxcache python -m scripts.bench_engine_warmup --size 1b   # warm

Prints one JSON line: size, slots, prompt, R, attention form, warm-up seconds, programs, each
program's compile seconds (they compile concurrently: the sum exceeds the warm-up), and the seconds
a second engine of the same configuration takes (it reuses the first one's programs).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", default="1b", help="a bench_generate size (5m, 100m, 1b, ...)")
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--prompt_len", type=int, default=128)
  parser.add_argument("--max_new_tokens", type=int, default=512)
  parser.add_argument("--n", type=int, default=1, help="samples per prompt")
  parser.add_argument("--kv_block_size", type=int, default=16)
  parser.add_argument("--paged_attention", default="auto")
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp

  from scripts import bench_generate
  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.generation.engine import SlotEngine
  from llamarl_jax.model.hf import config_from_hf

  config = config_from_hf(bench_generate.hf_config(args.size).to_dict(), dtype=jnp.dtype(args.dtype))
  build = lambda: SlotEngine(config, lanes=args.slots, max_prompt_len=args.prompt_len,
                             sampling=SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, n=args.n),
                             kv_block_size=args.kv_block_size, paged_attention=args.paged_attention)
  t = time.perf_counter()
  engine = build()
  first = time.perf_counter() - t
  t = time.perf_counter()
  build()
  second = time.perf_counter() - t
  p = engine.programs
  out = {"size": args.size, "device": jax.devices()[0].device_kind, "slots": args.slots, "prompt_len": args.prompt_len,
         "max_new_tokens": args.max_new_tokens, "n": args.n, "attention": p.attention_form,
         "cache_dir": jax.config.jax_compilation_cache_dir, "construct_s": first, "warmup_s": engine.warmup_s,
         "programs": p.num_compiled, "second_engine_s": second,
         "compile_s": {"/".join(map(str, k)): round(v, 2) for k, v in p.compile_seconds.items()}}
  print(json.dumps(out), flush=True)
  return out


if __name__ == "__main__":
  main()
