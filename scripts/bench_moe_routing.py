"""Routing disagreement and trainer-generator mismatch of a MoE policy, with and without routing replay.

    python scripts/bench_moe_routing.py runs/tiny_moe/hf_export [--prompts 64 --samples 4]

The policy (an HF `Qwen3MoeForCausalLM` directory, e.g. a `configs/tiny_moe.gin` run's export) samples
a batch of its task's prompts (`make run`'s arithmetic) with the slot engine in fp32 and in bf16, at
policy lag 0; an fp32 trainer forward (`model.logprobs.policy_logprobs`, the trainer step's) then
recomputes the sampled tokens' log-probs without and with the recorded routing replayed. Per
generator dtype, one row each way: the share of recorded (token, MoE layer) pairs whose top-k the
trainer routes differently (`moe.routing_disagreement`: the trainer's own top-k, so the same either
way) and the mismatch metrics of the trainer step (`mismatch.mismatch_metrics`: k3 KL, the
multiplicative probability error, the largest |log pi - log mu|).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def measure(config, params, prompts, sampling, dtype: str) -> list[dict]:
  from llamarl_jax import mismatch
  from llamarl_jax.generation.engine import SlotEngine
  from llamarl_jax.batch import routing_in_trainer_layout, trainer_layout
  from llamarl_jax.model import moe
  from llamarl_jax.model.forward import prepare_params
  from llamarl_jax.model.logprobs import policy_logprobs

  gen_config = config.replace(dtype=dtype, param_dtype=dtype)
  rows = len(prompts) * sampling.n
  engine = SlotEngine(gen_config, lanes=rows, sampling=sampling, max_prompt_len=16, progress=False)
  t0 = time.perf_counter()
  batch = engine.generate(jax.tree.map(lambda x: jnp.asarray(x, dtype), params), prompts, sampling)
  gen_s = time.perf_counter() - t0
  b = jax.tree.map(jnp.asarray, batch)
  recorded = routing_in_trainer_layout(b.prompt_mask, b.routing)
  _, lengths, _ = trainer_layout(b.prompt_tokens, b.prompt_mask, b.response_tokens, b.response_mask)
  seen = (jnp.arange(recorded.shape[1])[None] < lengths[:, None]) & jnp.all(recorded >= 0, axis=(2, 3))
  forward = jax.jit(lambda p, r: policy_logprobs(config, p, b.prompt_tokens, b.prompt_mask, b.response_tokens,
                                                 b.response_mask, replay=r, with_routing=True))
  prepared = prepare_params(jax.tree.map(jnp.asarray, params), "float32")
  out = []
  for replay in (False, True):
    logprobs, trace = forward(prepared, recorded if replay else None)
    m = mismatch.mismatch_metrics(logprobs, b.behaviour_logprobs, b.response_mask)
    mask = np.asarray(b.response_mask) > 0
    gap = np.abs(np.asarray(logprobs) - np.asarray(b.behaviour_logprobs))[mask]
    out.append({"generator": dtype, "replay": replay, "tokens": int(mask.sum()),
                "disagreement": float(moe.routing_disagreement(trace.topk, recorded, seen)),
                "kl_k3": float(m["rollout_corr/kl_k3"]),
                "mult_prob_error": float(m["rollout_corr/token_mult_prob_error"]),
                "max_abs_dlogp": float(gap.max()), "generate_s": gen_s})
  return out


def main(argv=None):
  from llamarl_jax.data import PromptSource
  from llamarl_jax.generation import SamplingParams
  from llamarl_jax.model import hf
  from llamarl_jax.model.llama import split_params

  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("model_path", help="an HF Qwen3-MoE directory (a run's hf_export)")
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--seed", type=int, default=123)
  p.add_argument("--dtypes", default="float32,bfloat16")
  args = p.parse_args(argv)

  config, model = hf.load_hf_checkpoint(args.model_path)
  if not config.num_experts:
    raise SystemExit(f"{args.model_path} is a dense model (model_type {config.model_type!r}); routing needs a MoE")
  tokenizer = hf.load_tokenizer(args.model_path)
  params = jax.device_get(split_params(model)[1])
  source = PromptSource(task="arithmetic", task_kwargs={"min_digits": 1, "max_digits": 2, "num_operands": 2,
                                                        "ops": "+"}, seed=args.seed)
  prompts = [ex.encode(tokenizer) for ex in source.next_batch(args.prompts)]
  stop = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=args.samples, stop_token_ids=stop, seed=args.seed)
  rows = [r for dtype in args.dtypes.split(",") for r in measure(config, params, prompts, sampling, dtype)]
  print(f"{config.num_experts} experts, top-{config.num_experts_per_tok}, {len(config.moe_layers)} MoE layers; "
        f"{len(prompts)} prompts x {args.samples} samples, lag 0, fp32 trainer forward")
  print("| generator | replay | tokens | routing disagreement | k3 KL | mult. prob. error | max abs dlogp |")
  print("|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['generator']} | {'on' if r['replay'] else 'off'} | {r['tokens']} | {100 * r['disagreement']:.2f}% | "
          f"{r['kl_k3']:.2e} | {r['mult_prob_error']:.4f} | {r['max_abs_dlogp']:.2e} |")


if __name__ == "__main__":
  main()
