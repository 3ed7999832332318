"""Packed sequences (`TrainConfig.pack`): rows laid end to end into rows of `tokens_per_microbatch`
tokens give the padded step's loss, gradient and metrics.

Each case trains one step on the same batch twice, padded (one microbatch) and packed, from the same
params, with gradient clipping off so that Adam's first moment after one step is (1 - b1) x the
gradient itself. Everything is fp32; packing changes only which positions share a forward row and
the order of sums (attention over the same keys: masked keys weigh exactly 0), so loss, metrics and
gradient agree to 1e-5 (relative; the gradient to 1e-5 of its largest entry). The batch's random
behaviour log-probs make the step off-policy (ratios != 1: clipping, truncation and GSPO's sequence
ratios are active).
"""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import mesh_at_most
from llamarl_jax import compat
from llamarl_jax import parallel
from llamarl_jax.config import ConfigError, LoraConfig, OptimizerConfig, TrainLayout
from llamarl_jax.executors.trainer import TrainerExecutor
from llamarl_jax.batch import RolloutBatch, ScoredBatch
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.train.layout import pack_rows

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=64, rope_theta=10000.0)
B, P, R, TOKENS = 8, 6, 10, 24
OPT = OptimizerConfig(lr=1e-3, eps=1e-6, max_grad_norm=0.0)  # no clipping: mu = (1 - b1) * gradient


def make_batch(seed, rows=B) -> ScoredBatch:
  """Rows with prompts of 1..P tokens (left-padded) and responses of 1..R tokens, one with a hole in
  its response mask (a tool observation's tokens), random behaviour log-probs, advantages +-1."""
  rng = np.random.RandomState(seed)
  pt, pm = np.zeros((rows, P), np.int32), np.zeros((rows, P), np.int32)
  rt, rm = np.zeros((rows, R), np.int32), np.zeros((rows, R), np.int32)
  for i, (p, r) in enumerate(zip(rng.randint(1, P + 1, rows), rng.randint(1, R + 1, rows))):
    pt[i, P - p:], pm[i, P - p:] = rng.randint(1, CONFIG.vocab_size, p), 1
    rt[i, :r], rm[i, :r] = rng.randint(1, CONFIG.vocab_size, r), 1
  rt[1, :R], rm[1, :R] = rng.randint(1, CONFIG.vocab_size, R), 1
  rm[1, 3:5] = 0
  blp = np.where(rm > 0, rng.uniform(-5, -2, (rows, R)), 0).astype(np.float32)
  adv = np.tile([1.0, -1.0], rows // 2).astype(np.float32)
  rollout = RolloutBatch(prompt_tokens=pt, prompt_mask=pm, response_tokens=rt, response_mask=rm,
                         behaviour_logprobs=blp, lengths=rm.sum(-1).astype(np.int32),
                         finish_reason=np.zeros(rows, np.int32), group_ids=np.arange(rows, dtype=np.int32) // 2,
                         policy_version=np.zeros(rows, np.int32), token_versions=np.zeros((rows, R), np.int32))
  return ScoredBatch(rollout=rollout, rewards=(adv > 0).astype(np.float32), advantages=adv)


@pytest.fixture(scope="module")
def params():
  return split_params(Llama(CONFIG, rngs=nnx.Rngs(0)))[1]


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def test_pack_rows_first_fit_decreasing_by_hand():
  """Rows longest first (ties by index) into the first bin with room; bins rounded up to the shards."""
  plan = pack_rows(np.array([5, 9, 3, 7, 2, 6]), tokens=12, shards=2)
  # 9 (row 1) -> bin 0; 7 (row 3) -> bin 1; 6 (row 5) -> bin 2; 5 (row 0) -> bin 1 (7+5=12);
  # 3 (row 2) -> bin 0 (9+3); 2 (row 4) -> bin 2 (6+2)
  np.testing.assert_array_equal(plan.row_bin, [1, 0, 0, 1, 2, 2])
  np.testing.assert_array_equal(plan.row_offset, [7, 0, 9, 0, 6, 0])
  np.testing.assert_array_equal(plan.row_slot, [1, 0, 1, 0, 1, 0])
  assert (plan.bins, plan.microbatches) == (4, 2)  # 3 bins used, rounded up to 2 shards
  assert plan.padding_fraction == pytest.approx((4 * 12 - 32) / 32)
  with pytest.raises(ValueError, match="tokens_per_microbatch"):
    pack_rows(np.array([13]), tokens=12)


CASES = {  # loss, its kwargs, trainer options: every loss, with LoRA, with remat, with a KL reference
    "aipo_kl_entropy": ("aipo", {"rho_max": 2.0, "entropy_coef": 0.01}, {"kl": True}),
    "ppo_clip_lora": ("ppo_clip", {"eps_high": 0.28}, {"lora": LoraConfig(rank=4, alpha=8.0)}),
    "gspo_remat": ("gspo", {}, {"remat": "full", "logprob_chunk": 5}),
    "cispo_lora_remat": ("cispo", {"aggregation": "seq_mean_token_mean"},
                         {"lora": LoraConfig(rank=2, alpha=4.0), "remat": "matmuls"}),
}


def trainer_lengths(batch: ScoredBatch) -> np.ndarray:
  """Each row's trainer length: real prompt tokens + response up to its last valid token."""
  r = batch.rollout
  return r.prompt_mask.sum(1) + R - np.argmax(r.response_mask[:, ::-1] > 0, axis=1)


@pytest.mark.parametrize("case", [c if c == "gspo_remat" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_packed_step_equals_padded_step(case, params):
  """Loss, metrics and gradient of the packed step are the padded step's; the packed trainer then
  steps a batch that packs into another number of bins with the same one compiled program (the
  step and the row-lengths program: 2 jit cache entries)."""
  loss, loss_kwargs, opts = CASES[case]
  opts = dict(opts)
  if opts.pop("kl", False):
    opts.update(ref_params=params, kl_coef=0.1)
  batch = make_batch(7)
  mesh = parallel.make_mesh(jax.devices()[:1]) if case != "cispo_lora_remat" else mesh_at_most(fsdp=2)
  runs = {}
  for name, layout in [("padded", TrainLayout()), ("packed", TrainLayout("packed", TOKENS))]:
    trainer = TrainerExecutor(CONFIG, mesh, params, optimizer=OPT, loss=loss, loss_kwargs=loss_kwargs, **opts,
                              layout=layout)
    metrics = trainer.step(batch)
    runs[name] = (metrics, host(trainer.opt_state[0].mu))
  (padded, mu_padded), (packed, mu_packed) = runs["padded"], runs["packed"]
  assert set(packed) == set(padded)
  for k in sorted(set(padded) - {"time/train_step", "train/padding_fraction"}):
    np.testing.assert_allclose(packed[k], padded[k], rtol=1e-5, atol=1e-7, err_msg=k)
  assert padded["train/update_applied"] == 1 and padded["policy/kl_behaviour"] > 0.1  # off-policy
  scale = max(np.abs(x).max() for x in jax.tree.leaves(mu_padded))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(mu_packed), jax.tree.leaves(mu_padded)):
    np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0, err_msg=jax.tree_util.keystr(path))
  # padded: B * (P + R) positions; packed: the bins' TOKENS each (rounded up to the shards)
  shards = parallel.batch_divisor(mesh)
  plan = pack_rows(trainer_lengths(batch), TOKENS, shards)
  assert packed["train/padding_fraction"] == pytest.approx(plan.padding_fraction, rel=1e-6)
  assert packed["train/padding_fraction"] < padded["train/padding_fraction"]
  other = make_batch(45)  # 6 bins, against batch 7's 4
  assert pack_rows(trainer_lengths(other), TOKENS, shards).bins != plan.bins
  assert np.isfinite(trainer.step(other)["loss/total"])
  assert compat.jit_cache_size(trainer.programs.packed_step) == 1 and trainer.trace_count == 2


def test_pack_needs_a_token_budget_that_holds_a_row(params):
  mesh = parallel.make_mesh(jax.devices()[:1])
  with pytest.raises(ConfigError, match="tokens_per_microbatch"):
    TrainerExecutor(CONFIG, mesh, params, layout=TrainLayout("packed"))
  with pytest.raises(ConfigError, match="microbatches = 1"):
    TrainerExecutor(CONFIG, mesh, params, layout=TrainLayout("packed", TOKENS), microbatches=2)
  trainer = TrainerExecutor(CONFIG, mesh, params, layout=TrainLayout("packed", P + R - 1))
  with pytest.raises(ValueError, match="at least P \\+ R"):
    trainer.step(make_batch(1))
