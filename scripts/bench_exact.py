#!/usr/bin/env python
"""What `exact_logprobs` removes, op by op, and what it costs: the generator's behaviour log-probs
against the trainer's, and the RL step's parts with the switch and without.

Residuals: the policy at `make run`'s sizes (configs/tiny_cpu.gin: hidden 128, 4 layers, 4 heads, 2
KV heads, tied embedding; rope_theta 500000, Llama 3's) from a random init, 16 prompts of 3-7
tokens x 2 samples of 8 tokens at temperature 1. The generator (the static sampler: left-padded
prompts, prefill then decode over a dense KV cache; and the slot engine: prefill then decode over a
paged pool, 8 slots) runs on a data-parallel mesh of 2 devices, the trainer (`token_logprobs`, padded
rows) on one. Per row of the table: every op in its batch-invariant form (`model.exact`) but the
named one, which runs as the default mode computes it; the largest |log mu - log pi| over the
response tokens. 'none' is the default mode, 'all' the switch itself (0 when the switch holds).

  - dense: `x @ w` (XLA picks the kernel from the row count: a GEMV for one row, another GEMM for 7)
  - dense split by the partitioner: fixed-tile dots, but no `shard_map` over the mesh's batch axes
    (XLA's SPMD partitioner splits a 64-row tile into two 32-row dots)
  - RMSNorm, RoPE (angles and rotation), the RoPE frequencies computed in the program, attention
    (one masked softmax per program shape), residual adds (bf16: excess precision), SwiGLU, the
    log-softmax (its vectorised sum)
  - with `--moe` (the policy as configs/tiny_moe.gin makes it: Qwen3-MoE, 4 sparse layers of 4 experts
    of 192, top-2, renormalised; each token routed by its own top-k on both sides, no replay), also the
    router's softmax and the experts' grouped matmul (`jax.lax.ragged_dot`: one matmul over all rows)

Costs (`--cost`): the same policy in `make run`'s RL configuration (trainer FSDP over 2 devices,
generator data-parallel over 2, 16 prompts x 8 samples, AIPO, lag 1), `--steps` RL steps with the
switch and without, alternating `--rounds` times; per arm the median over steps (the first two
compile) of the step time, the trainer's step and the generator's busy time, the ratio exact /
default, the better of the rounds (one run of each per round, so a shared machine's load falls on
both).

  python -m llamarl_jax.compat --cpu_devices 4 -- python scripts/bench_exact.py [--dtypes float32,bfloat16] [--cost] [--moe]
      [--ops 'MoE router softmax,MoE grouped matmul']
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import parallel
from llamarl_jax.model import exact
from llamarl_jax.model import attention as attention_lib
from llamarl_jax.model import config as config_lib
from llamarl_jax.model import forward as forward_lib
from llamarl_jax.model import layers
from llamarl_jax.model import llama as llama_lib
from llamarl_jax.model.paged_attention import rope_rotate

F32 = jnp.float32


def plain_dense(x, w, *, n_in=1, out_dtype=None, tile=exact.ROW_TILE):
  return jnp.tensordot(x, w.astype(x.dtype), n_in, preferred_element_type=F32).astype(out_dtype or x.dtype)


def plain_paged_attention(q, k_pool, v_pool, index, lengths, *, block=exact.KEY_BLOCK):
  NB, bs, KV, D = k_pool.shape
  k = k_pool.reshape(NB * bs, KV, D)[index.astype(jnp.int32)]
  v = v_pool.reshape(NB * bs, KV, D)[index.astype(jnp.int32)]
  return exact.attention_reference(q, k, v, lengths.reshape(-1, 1))


def plain_token_logprob(logits, tokens, temperature=1.0):
  x = logits.astype(F32) / temperature
  picked = jnp.take_along_axis(x, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(x, axis=-1)


def plain_grouped_dot(rows, w, sizes, *, out_dtype=None, tile=exact.ROW_TILE):
  return jax.lax.ragged_dot(rows, w.astype(rows.dtype), sizes, preferred_element_type=F32).astype(out_dtype or rows.dtype)


def program_frequencies(config):
  return config_lib.frequencies_in(config, jnp)


# op kind -> {(module, attribute): the default mode's form}
PLAIN = {
    "dense": {(exact, "dense"): plain_dense},
    "dense split by the partitioner": {(exact, "tiled_dot"): exact.local_tiled_dot},
    "RMSNorm": {(exact, "rms_norm"): lambda x, scale, eps: layers.rms_norm(x, scale, eps)},
    "RoPE": {(exact, "rope_cos_sin"): attention_lib.rope_cos_sin, (exact, "rope"): rope_rotate},
    "RoPE frequencies in the program": {(llama_lib, "rope_frequencies"): program_frequencies,
                                        (forward_lib, "rope_frequencies"): program_frequencies},
    "attention": {(exact, "attention"): lambda q, k, v, lengths, starts=None, *, block=exact.KEY_BLOCK:
                  exact.attention_reference(q, k, v, lengths, starts),
                  (exact, "paged_attention"): plain_paged_attention},
    "residual add": {(exact, "add"): lambda x, y: x + y.astype(x.dtype)},
    "SwiGLU": {(exact, "swiglu"): lambda gate, up: jax.nn.silu(gate) * up},
    "log-softmax": {(exact, "token_logprob"): plain_token_logprob},
}
MOE_PLAIN = {
    "MoE router softmax": {(exact, "softmax"): lambda x: jax.nn.softmax(x.astype(F32), axis=-1)},
    "MoE grouped matmul": {(exact, "grouped_dot"): plain_grouped_dot},
}


@contextlib.contextmanager
def patched(replacements: dict):
  """The named attributes replaced for the duration (jit caches cleared on entry and exit, so every
  program is traced with what is in place)."""
  saved = {key: getattr(*key) for key in replacements}
  jax.clear_caches()
  try:
    for (module, name), fn in replacements.items():
      setattr(module, name, fn)
    yield
  finally:
    for (module, name), fn in saved.items():
      setattr(module, name, fn)
    jax.clear_caches()


def tiny_policy(dtype: str, exact_ops: bool, vocab: int = 100, moe: bool = False):
  from flax import nnx

  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params

  experts = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=192,
                 norm_topk_prob=True) if moe else {}
  config = ModelConfig(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=True, dtype=dtype,
                       param_dtype=dtype, exact=exact_ops, **experts)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  return config, params


def residual(dtype: str, exact_ops: bool, engine: bool, moe: bool = False) -> float:
  """max |behaviour - trainer| over the response tokens of one generation (see the module doc)."""
  from llamarl_jax.generation import Sampler, SamplingParams
  from llamarl_jax.generation.engine import SlotEngine
  from llamarl_jax.model.llama import abstract_model, split_params
  from llamarl_jax.model.logprobs import token_logprobs

  config, params = tiny_policy(dtype, exact_ops, moe=moe)
  mesh = parallel.make_mesh(jax.devices()[:2], data=2)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(4, 100, int(n)).tolist() for n in rng.integers(3, 8, 16)]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=1)
  if engine:
    gen = SlotEngine(config, mesh, lanes=8, sampling=sampling, max_prompt_len=8, chunk_steps=4, kv_block_size=4)
    batch = gen.generate(params, prompts, sampling)
  else:
    batch = Sampler(config, mesh, batch_multiple=8).generate(params, prompts, sampling)
  graphdef = split_params(abstract_model(config))[0]
  pi = token_logprobs(graphdef, params, batch.prompt_tokens, batch.prompt_mask, batch.response_tokens,
                      batch.response_mask, temperature=1.0)
  m = np.asarray(batch.response_mask).astype(bool)
  return float(np.max(np.abs(np.asarray(batch.behaviour_logprobs)[m] - np.asarray(pi)[m])))


def residual_table(dtypes: list[str], moe: bool = False, ops: list[str] | None = None) -> None:
  head = f"{'ops':<44}" + "".join(f" {f'{d} {g}':>22}" for d in dtypes for g in ("sampler", "engine"))
  print("max |log mu - log pi| over the response tokens (exact form for every op but the one named)")
  print(head)
  print("-" * len(head))
  rows = [("none (the default mode)", None), ("all (exact_logprobs)", {})] + [
      (f"all but {name}", replacements) for name, replacements in {**PLAIN, **(MOE_PLAIN if moe else {})}.items()
      if ops is None or name in ops]
  for label, replacements in rows:
    cells = []
    for d in dtypes:
      for engine in (False, True):
        if replacements is None:
          cells.append(residual(d, False, engine, moe))
        else:
          with patched(replacements):
            cells.append(residual(d, True, engine, moe))
    print(f"{label:<44}" + "".join(f" {c:>22.3g}" for c in cells), flush=True)


def rl_costs(dtype: str, steps: int, rounds: int, moe: bool = False) -> None:
  from llamarl_jax.config import OptimizerConfig, run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  keys = ("time/step", "time/train", "time/generate_busy")
  best = {arm: {k: float("inf") for k in keys} for arm in ("default", "exact")}
  for r in range(rounds):
    for arm in ("exact", "default"):
      config, params = tiny_policy(dtype, False, vocab=len(tokenizer), moe=moe)  # the run's switch sets `exact`
      run = run_config(reward_fn="arithmetic", prompts_per_step=16, samples_per_prompt=8, max_new_tokens=8,
                       trainer_fsdp=2, generator_dp=2, optimizer=OptimizerConfig(lr=1e-3), max_policy_lag=1,
                       step_timeout_s=600, exact_logprobs=arm == "exact", scan_layers=False)
      run = dataclasses.replace(run, generator=dataclasses.replace(run.generator, dtype=dtype, max_prompt_len=16))
      with tempfile.TemporaryDirectory() as tmp:
        c = Controller(config, params, tokenizer, PromptSource(task="arithmetic", seed=0), run_dir=tmp, config=run,
                       reward=RewardExecutor("arithmetic", inline=True), progress=False)
        try:
          metrics = c.run(steps)[2:]
        finally:
          c.close()
      for k in keys:
        best[arm][k] = min(best[arm][k], float(np.median([m[k] for m in metrics])))
      print(f"  round {r} {arm:<8} " + "  ".join(f"{k} {float(np.median([m[k] for m in metrics])):.3f}s"
                                              for k in keys), flush=True)
  print(f"\nRL step parts, {dtype}, median over steps 3-{steps}, best of {rounds} rounds")
  head = f"{'':<22} {'default s':>10} {'exact s':>10} {'exact / default':>16}"
  print(head)
  print("-" * len(head))
  for k in keys:
    d, e = best["default"][k], best["exact"][k]
    print(f"{k:<22} {d:>10.3f} {e:>10.3f} {e / d:>16.2f}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dtypes", default="float32,bfloat16")
  parser.add_argument("--cost", action="store_true", help="also time the RL step's parts with and without")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--moe", action="store_true", help="a mixture-of-experts policy (configs/tiny_moe.gin's)")
  parser.add_argument("--ops", default=None, help="comma-separated op kinds for the 'all but' rows (default: every one)")
  args = parser.parse_args(argv)
  if len(jax.devices()) < 4:
    raise SystemExit(f"needs 4 devices (generator dp 2, trainer fsdp 2), got {len(jax.devices())}: run under "
                     "python -m llamarl_jax.compat --cpu_devices 4 -- ...")
  print(f"jax {jax.__version__}, {jax.devices()[0].platform} x {len(jax.devices())}\n")
  dtypes = args.dtypes.split(",")
  ops = None if args.ops is None else args.ops.split(",")
  unknown = set(ops or ()) - set(PLAIN) - set(MOE_PLAIN if args.moe else ())
  if unknown:
    raise SystemExit(f"--ops {sorted(unknown)}: not op kinds of this table ({', '.join([*PLAIN, *MOE_PLAIN])}; "
                     "the MoE ones with --moe)")
  residual_table(dtypes, args.moe, ops)
  if args.cost:
    for d in dtypes:
      rl_costs(d, args.steps, args.rounds, args.moe)


if __name__ == "__main__":
  main()
