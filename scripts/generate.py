#!/usr/bin/env python
"""Sample completions from a checkpoint, for a quick look.

  python scripts/generate.py --checkpoint path/to/hf_dir --prompt "Q: 2+2=?" --max_new_tokens 32
  python scripts/generate.py --random_tiny --prompt "12+3=" --temperature 0.8 --n 2

--checkpoint: a Hugging Face Llama 3 / Qwen2 / Qwen3 directory (config.json, safetensors, tokenizer files).
--random_tiny: a tiny randomly initialised model with the character tokenizer (gibberish, but it
exercises the whole path in seconds on a CPU). The tokenizer's EOS stops a row.
"""

import argparse
import time


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--checkpoint", help="Hugging Face Llama / Qwen2 / Qwen3 directory")
  source.add_argument("--random_tiny", action="store_true", help="tiny random model + character tokenizer")
  parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
  parser.add_argument("--max_new_tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
  parser.add_argument("--top_p", type=float, default=1.0)
  parser.add_argument("--top_k", type=int, default=0)
  parser.add_argument("--n", type=int, default=1, help="samples per prompt")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default="float32", help="params and compute dtype, e.g. bfloat16")
  parser.add_argument("--dp", type=int, default=1, help="generator mesh: data-parallel size")
  parser.add_argument("--tp", type=int, default=1, help="generator mesh: tensor-parallel size")
  args = parser.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from llamarl_jax import parallel
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.model import ModelConfig, init_model, load_hf_checkpoint, load_tokenizer

  mesh = parallel.make_mesh(jax.devices()[:args.dp * args.tp], data=args.dp, tp=args.tp)
  if args.random_tiny:
    from llamarl_jax.tokenizer import make_char_tokenizer

    tokenizer = make_char_tokenizer()
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, param_dtype=args.dtype, dtype=args.dtype)
    model = init_model(config, seed=args.seed)
  else:
    config, model = load_hf_checkpoint(args.checkpoint, dtype=jnp.dtype(args.dtype), mesh=mesh)
    tokenizer = load_tokenizer(args.checkpoint)

  stops = tuple(t for t in [tokenizer.eos_token_id] if t is not None)
  sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, n=args.n, stop_token_ids=stops, seed=args.seed)
  sampler = Sampler(config, mesh, pad_id=tokenizer.pad_token_id or 0)
  prompts = [tokenizer(p)["input_ids"] for p in args.prompt]

  start = time.perf_counter()
  batch = jax.block_until_ready(sampler.generate(model, prompts, sampling)).to_host()
  seconds = time.perf_counter() - start
  for row in range(batch.batch_size):
    tokens = batch.response_tokens[row][batch.response_mask[row].astype(bool)]
    finish = "stop" if batch.finish_reason[row] == 0 else "length"
    mean_lp = batch.behaviour_logprobs[row].sum() / max(batch.lengths[row], 1)
    print(f"--- prompt {batch.group_ids[row]} | {batch.lengths[row]} tokens, {finish}, "
          f"mean logprob {mean_lp:.3f}")
    print(args.prompt[batch.group_ids[row]] + tokenizer.decode(tokens.tolist(), skip_special_tokens=True))
  n_tokens = int(np.sum(batch.lengths))
  print(f"--- {n_tokens} tokens in {seconds:.2f}s (first call includes compilation)")


if __name__ == "__main__":
  main()
