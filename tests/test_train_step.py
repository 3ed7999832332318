"""The trainer's pure step (`llamarl_jax.train`): a function of (state, batch), compiled once per
configuration, and the supervised warm start as the same step with the negative log-likelihood."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llamarl_jax import compat
from llamarl_jax import losses
from llamarl_jax.config import OptimizerConfig
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.model.logprobs import token_logprobs
from llamarl_jax.train import StepSpec, init_state, train_step

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=32, rope_theta=10000.0)
B, P, R = 4, 5, 6


def sft_batch(seed):
  """Rows of 1..P prompt tokens (left-padded) and 1..R target tokens; no behaviour log-probs (zeros)."""
  rng = np.random.RandomState(seed)
  pt, pm, rt, rm = (np.zeros((B, n), np.int32) for n in (P, P, R, R))
  for i in range(B):
    p, r = rng.randint(1, P + 1), rng.randint(1, R + 1)
    pt[i, P - p:], pm[i, P - p:] = rng.randint(1, 64, p), 1
    rt[i, :r], rm[i, :r] = rng.randint(1, 64, r), 1
  return {"prompt_tokens": pt, "prompt_mask": pm, "response_tokens": rt, "response_mask": rm,
          "behaviour_logprobs": np.zeros((B, R), np.float32), "advantages": np.zeros(B, np.float32),
          "token_versions": np.full((B, R), -1, np.int32)}


def test_sft_step_is_the_train_step_with_the_nll_and_compiles_once():
  """The warm start's step (`experiment.supervised_warmstart` builds exactly this spec shape): its
  loss is the mean negative log-likelihood of the target tokens under the step's starting params
  (`token_logprobs`, an independent forward; fp32, 1e-6), it updates the params and counts the step;
  new batches of the same shapes reuse the one compiled program (the jit cache holds 1 entry)."""
  graphdef, params = split_params(Llama(CONFIG, rngs=nnx.Rngs(0)))
  spec = StepSpec(model=CONFIG, loss=losses.nll_loss, optimizer=OptimizerConfig(lr=1e-2, b2=0.999),
                  logprob_chunk=None, mismatch=False)
  step = jax.jit(functools.partial(train_step, spec))
  forward = jax.jit(functools.partial(token_logprobs, graphdef))
  state = init_state(params, spec.tx)
  for seed in range(2):
    batch = sft_batch(seed)
    lp = forward(state.params, batch["prompt_tokens"], batch["prompt_mask"], batch["response_tokens"],
                 batch["response_mask"])
    want = -float(jnp.sum(lp)) / batch["response_mask"].sum()
    before = state.params
    state, metrics = step(state, batch)
    assert float(metrics["loss/total"]) == pytest.approx(want, rel=1e-6)
    assert float(metrics["train/update_applied"]) == 1 and int(state.step) == seed + 1
    assert not np.array_equal(np.asarray(state.params["embed"]), np.asarray(before["embed"]))
  assert compat.jit_cache_size(step) == 1
  assert "rollout_corr/mismatch_kl" not in metrics  # mismatch=False: no behaviour policy to compare with


def test_nll_loss_by_hand():
  """token_mean over valid tokens: -(-1 - 2 - 3) / 3 = 2; the other arguments are unused."""
  lp = jnp.array([[-1.0, -2.0, 0.0], [-3.0, -9.0, -9.0]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]])
  loss, metrics = losses.nll_loss(lp, None, None, mask)
  assert float(loss) == pytest.approx(2.0)
  assert float(metrics["policy/num_tokens"]) == 3 and float(metrics["policy/num_seqs"]) == 2
