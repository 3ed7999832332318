"""TrainerExecutor: the sharded, microbatched, NaN-safe policy-gradient step, and its microbatches
grouped by length.

Compiling a train step dominates this file's time (a few seconds each on CPU), so trainers are
shared: `reference_run` (one device, 5 steps on one fixed on-policy batch) is the baseline for the
overfitting, accumulation, sharding and bf16 tests, and `shared_trainer` (fsdp x tp, microbatched)
serves the sharding, NaN, compile-count and checkpoint tests (each asserts relative to the state it
finds, so their order does not matter).

Tolerances: everything is fp32; a different microbatch split or device count only changes summation
order (~1e-7 relative on gradients). Adam's update g / (sqrt(v) + eps) amplifies such differences for
entries with |g| ~ eps, so the equivalence tests use eps = 1e-6 and compare (a) the first moment
mu = (1 - b1) * clipped grad, i.e. the accumulated gradient itself, to 1e-5 of its largest entry, and
(b) params to 1e-5 absolute, 1% of one lr-sized (1e-3) Adam step. Grouping rows by length changes
which rows share a microbatch and the widths they run at (padding: exact zeros in every sum), so the
same summation-order bounds apply.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import mesh_at_most
from sequence_layout import sequence_layout
from llamarl_jax import compat
from llamarl_jax import parallel
from llamarl_jax.executors.trainer import OptimizerConfig, TrainerExecutor, TrainLayout
from llamarl_jax.batch import RolloutBatch, ScoredBatch
from llamarl_jax.mismatch import MISMATCH_LAGS
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, merge_params, split_params
from llamarl_jax.model.logprobs import token_logprobs
from llamarl_jax.train.layout import group_by_length, width_bucket
from llamarl_jax.train.state import lr_schedule, make_optimizer

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=2, max_position_embeddings=64, rope_theta=10000.0)
B, P, R = 8, 6, 8
OPT = OptimizerConfig(lr=1e-3, eps=1e-6)
LOSS_KW = {"rho_max": 2.0}
REF_STEPS = 5

# One compile serves every use in this file: temperature is traced, entropy always computed.
logprobs_fn = jax.jit(functools.partial(token_logprobs, with_entropy=True), static_argnums=0)


def one_device_mesh():
  return parallel.make_mesh(jax.devices()[:1])


def fsdp_mesh(fsdp, tp=1):
  return parallel.make_mesh(jax.devices()[:fsdp * tp], fsdp=fsdp, tp=tp)


# What the tests below that check sharding itself need (`test_sharded_step_matches_single_device`);
# the fixtures that merely run on a mesh shrink to the devices present (`mesh_at_most`).
SHARDED_DEVICES = 4


def make_batch(seed, params=None, graphdef=None, nan_row=None) -> ScoredBatch:
  """B rows of random prompts/responses with varied lengths; advantages alternate +1, -1.

  With `params`, behaviour log-probs are the policy's own (on-policy), else random in [-5, -1].
  """
  rng = np.random.RandomState(seed)
  prompt_len = rng.randint(1, P + 1, B)
  resp_len = rng.randint(1, R + 1, B)
  resp_len[0] = R
  return rows_batch(rng, prompt_len, resp_len, P, R, params, graphdef, nan_row)


# bench_generate.py's longtail workload: each response stops with probability 1/32 per token, capped
LONG_P, LONG_R, LONG_MEAN = 16, 256, 32


def long_tail_batch(seed, mean=LONG_MEAN, rows=64) -> ScoredBatch:
  """`rows` rows shaped like bench_generate.py's `longtail` workload: response lengths geometric with
  mean `mean` (a stop with probability 1/mean per token), capped at LONG_R; prompts of 4..LONG_P
  tokens, left-padded; random behaviour log-probs."""
  rng = np.random.RandomState(seed)
  resp_len = np.minimum(rng.geometric(1 / mean, rows), LONG_R)
  prompt_len = rng.randint(4, LONG_P + 1, rows)
  return rows_batch(rng, prompt_len, resp_len, LONG_P, LONG_R)


def rows_batch(rng, prompt_len, resp_len, P, R, params=None, graphdef=None, nan_row=None) -> ScoredBatch:
  """Rows of random tokens with the given prompt (left-padded to P) and response (right-padded to R)
  lengths; see `make_batch`."""
  B = len(prompt_len)
  pt, pm = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
  rt, rm = np.zeros((B, R), np.int32), np.zeros((B, R), np.int32)
  for i in range(B):
    pt[i, P - prompt_len[i]:] = rng.randint(1, CONFIG.vocab_size, prompt_len[i])
    pm[i, P - prompt_len[i]:] = 1
    rt[i, :resp_len[i]] = rng.randint(1, CONFIG.vocab_size, resp_len[i])
    rm[i, :resp_len[i]] = 1
  if params is not None:
    blp = np.asarray(logprobs_fn(graphdef, params, pt, pm, rt, rm, temperature=1.0)[0])
  else:
    blp = np.where(rm > 0, rng.uniform(-5, -1, (B, R)), 0).astype(np.float32)
  adv = np.tile([1.0, -1.0], B // 2).astype(np.float32)
  if nan_row is not None:
    adv[nan_row] = np.nan
  rollout = RolloutBatch(prompt_tokens=pt, prompt_mask=pm, response_tokens=rt, response_mask=rm,
                         behaviour_logprobs=blp, lengths=rm.sum(-1).astype(np.int32),
                         finish_reason=np.zeros(B, np.int32), group_ids=np.arange(B, dtype=np.int32) // 2,
                         policy_version=np.zeros(B, np.int32), token_versions=np.zeros((B, R), np.int32))
  return ScoredBatch(rollout=rollout, rewards=(adv > 0).astype(np.float32), advantages=adv)


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_close(a, b, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(host(a)), jax.tree.leaves(host(b))):
    np.testing.assert_allclose(x, y, atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path))


def mu(opt_state):
  """Adam's first moment inside chain(clip_by_global_norm, adamw)."""
  return opt_state[1][0].mu


@pytest.fixture(scope="module")
def model_params():
  """(graphdef, host params), numpy-filled: jit-compiling `init_model` alone costs ~5 s on CPU."""
  graphdef, shapes = split_params(nnx.eval_shape(lambda: Llama(CONFIG, rngs=nnx.Rngs(0))))
  rng = np.random.RandomState(0)
  init = lambda s: (np.ones(s.shape) if len(s.shape) == 1 else
                    rng.normal(0, 1 / np.sqrt(s.shape[0]), s.shape)).astype(np.float32)
  return graphdef, jax.tree.map(init, shapes)


@pytest.fixture(scope="module")
def fixed_batch(model_params):
  return make_batch(1, *model_params[::-1])


def run_steps(trainer, batch, steps):
  """`steps` steps on `batch`: per step its metrics and a host copy of the state."""
  metrics, states = [], []
  for _ in range(steps):
    metrics.append(trainer.step(batch))
    states.append(host({"params": trainer.params, "opt_state": trainer.opt_state}))
  return metrics, states


@pytest.fixture(scope="module")
def reference_run(model_params, fixed_batch):
  """One device, REF_STEPS steps on `fixed_batch`: per step its metrics, state and sequence log-liks."""
  graphdef, params = model_params
  trainer = TrainerExecutor(CONFIG, one_device_mesh(), params, optimizer=OPT, loss_kwargs=LOSS_KW)
  metrics, states = run_steps(trainer, fixed_batch, REF_STEPS)
  r = fixed_batch.rollout
  loglik = [np.asarray(logprobs_fn(graphdef, p, r.prompt_tokens, r.prompt_mask, r.response_tokens,
                                   r.response_mask, temperature=1.0)[0].sum(-1))
            for p in [params] + [s["params"] for s in states]]
  return {"metrics": metrics, "states": states, "loglik": loglik, "trainer": trainer}


@pytest.fixture(scope="module")
def shared_trainer(model_params, fixed_batch):
  """fsdp=2 x tp=2 fake devices (fewer where fewer are present), 2 microbatches; its first 3 steps (on
  `fixed_batch`) are recorded for the sharding test, then the NaN, compile-count and checkpoint tests
  keep stepping it."""
  trainer = TrainerExecutor(CONFIG, mesh_at_most(fsdp=2, tp=2), model_params[1], optimizer=OPT,
                            loss_kwargs=LOSS_KW, microbatches=2)
  trainer.first_steps = run_steps(trainer, fixed_batch, 3)
  return trainer


@pytest.fixture(scope="module")
def bf16_ppo_run(model_params, fixed_batch):
  """bf16 compute, PPO-clip loss, KL to a reference (the initial params) on an fsdp=2 mesh (or fewer)."""
  trainer = TrainerExecutor(CONFIG.replace(dtype="bfloat16"), mesh_at_most(fsdp=2), model_params[1],
                            optimizer=OptimizerConfig(lr=1e-2), loss="ppo_clip",
                            loss_kwargs={"eps_high": 0.28}, ref_params=model_params[1], kl_coef=0.1)
  metrics, states = run_steps(trainer, fixed_batch, 2)
  return {"metrics": metrics, "states": states, "trainer": trainer}


# --------------------------------------------------------------------------------------------------


def test_token_logprobs_match_full_forward(model_params):
  """Slicing hidden states before the lm_head gives the full-logits log-softmax at index P-1+t."""
  graphdef, params = model_params
  b = make_batch(0).rollout
  T = 0.7
  args = (b.prompt_tokens, b.prompt_mask, b.response_tokens, b.response_mask)
  lp, ent = logprobs_fn(graphdef, params, *args, temperature=T)

  @jax.jit
  def reference(params, *args):
    tokens, pos, mask = sequence_layout(*args)
    logits = merge_params(graphdef, params)(tokens, positions=pos, attention_mask=mask)
    logp = jax.nn.log_softmax(logits[:, P - 1:P + R - 1] / T)
    picked = jnp.take_along_axis(logp, args[2][..., None], -1)[..., 0]
    return picked, -jnp.sum(jnp.exp(logp) * logp, -1)

  ref_lp, ref_ent = reference(params, *args)
  valid = b.response_mask > 0
  np.testing.assert_allclose(np.asarray(lp)[valid], np.asarray(ref_lp)[valid], atol=1e-5)
  np.testing.assert_allclose(np.asarray(ent)[valid], np.asarray(ref_ent)[valid], atol=1e-5)
  assert np.all(np.asarray(lp)[~valid] == 0) and np.all(np.asarray(ent)[~valid] == 0)


def test_lr_schedule_warmup_cosine_and_decay_mask():
  cfg = OptimizerConfig(lr=1.0, warmup_steps=4, schedule="cosine", total_steps=12, final_lr_ratio=0.1)
  lrs = np.asarray(jax.jit(jax.vmap(lr_schedule(cfg)))(jnp.arange(14)))
  np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0], atol=1e-6)  # first update not at lr 0
  assert np.all(np.diff(lrs[4:13]) < 0)  # cosine decays monotonically ...
  np.testing.assert_allclose(lrs[12:], 0.1, atol=1e-6)  # ... to lr * final_lr_ratio, then stays
  constant = OptimizerConfig(lr=2.0, warmup_steps=2)
  np.testing.assert_allclose(jax.jit(jax.vmap(lr_schedule(constant)))(jnp.arange(4)), [1.0, 2.0, 2.0, 2.0])
  # weight decay shrinks matrices but not norm scales (zero gradient: only the decay moves params)
  tx = make_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5))
  params = {"w": jnp.ones((2, 2)), "norm": jnp.ones((2,))}
  updates = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0])(params)
  np.testing.assert_allclose(updates["w"], -0.05)
  np.testing.assert_allclose(updates["norm"], 0.0)


def test_overfit_moves_loglik_with_advantage_sign(reference_run, fixed_batch):
  """Repeated steps on one batch: log pi of A>0 sequences rises, of A<0 falls, at every step."""
  h = np.stack(reference_run["loglik"])  # [steps + 1, B] sequence log-likelihoods
  pos, neg = fixed_batch.advantages > 0, fixed_batch.advantages < 0
  assert np.all(np.diff(h[:, pos].mean(1)) > 0), h[:, pos].mean(1)
  assert np.all(np.diff(h[:, neg].mean(1)) < 0), h[:, neg].mean(1)
  assert h[-1, pos].mean() - h[0, pos].mean() > 0.2  # a real move (nats per sequence), not noise
  m = reference_run["metrics"]
  assert [x["train/step"] for x in m] == list(range(1, REF_STEPS + 1))
  assert m[-1]["train/skipped_nonfinite"] == 0
  np.testing.assert_allclose(m[0]["policy/ratio_mean"], 1.0, atol=1e-5)  # on-policy at the first step
  assert m[-1]["policy/ratio_max"] > 1.0  # later steps are off-policy w.r.t. the fixed batch
  for key in ("loss/total", "train/grad_norm", "train/lr", "time/train_step"):
    assert np.isfinite(m[-1][key]), key
  assert m[-1]["train/tokens"] == fixed_batch.rollout.response_mask.sum()
  assert reference_run["trainer"].busy_seconds >= sum(x["time/train_step"] for x in m)


def test_mismatch_metrics_split_by_lag(reference_run, fixed_batch):
  """Every step trains `fixed_batch` (token versions 0), so step k (params version k) sees lag k only:
  its tokens all fall in `rollout_corr/lag{k}` (k < MISMATCH_LAGS = 4; lag 4 is in the totals only).
  At lag 0 the behaviour log-probs are the trainer's own function of the same params, computed in
  another program: they agree to ~1e-7 (the 1e-5 of test_token_logprobs_match_full_forward bounds
  it), so k3 <= (1e-5)^2 / 2 = 5e-11 and the ratios are 1 within 1e-5."""
  m = reference_run["metrics"]
  tokens = float(fixed_batch.rollout.response_mask.sum())
  for k, step in enumerate(m):
    lag_keys = {key.split("/")[1] for key in step if key.startswith("rollout_corr/lag")}
    assert lag_keys == ({f"lag{k}"} if k < MISMATCH_LAGS else set()), (k, lag_keys)
    assert step["rollout_corr/num_tokens"] == tokens
    if k < MISMATCH_LAGS:
      assert step[f"rollout_corr/lag{k}/num_tokens"] == tokens
      assert step[f"rollout_corr/lag{k}/kl_k3"] == step["rollout_corr/kl_k3"]
  assert m[0]["rollout_corr/lag0/kl_k3"] < 5e-11
  assert abs(m[0]["rollout_corr/lag0/ratio_max"] - 1) < 1e-5
  assert m[0]["rollout_corr/lag0/token_mult_prob_error"] - 1 < 1e-5
  # the policy moved: later lags see a real mismatch, growing with the steps taken on this batch
  kl = [step["rollout_corr/kl_k3"] for step in m]
  assert kl[1] > 1e-6 and all(b > a for a, b in zip(kl[1:], kl[2:])), kl
  # the same estimator as the loss's off-policyness metric (k3 of KL(mu || pi)), over the same tokens
  np.testing.assert_allclose([s["rollout_corr/kl_k3"] for s in m], [s["policy/kl_behaviour"] for s in m],
                             rtol=1e-4, atol=1e-12)


def test_grad_accumulation_equals_one_big_batch(model_params, fixed_batch, reference_run):
  """4 microbatches (with remat) of unequal token counts give the full batch's gradient and update.

  Each microbatch loss is a token mean over its own tokens, weighted by its share of the batch's
  tokens; a plain mean of the microbatch means would give another loss (here even of the other
  sign) and gradient.
  """
  ref_metrics, ref_state = reference_run["metrics"][0], reference_run["states"][0]
  acc = TrainerExecutor(CONFIG, one_device_mesh(), model_params[1], optimizer=OPT, loss_kwargs=LOSS_KW,
                        microbatches=4, remat=True)
  m = acc.step(fixed_batch)
  np.testing.assert_allclose(m["loss/total"], ref_metrics["loss/total"], rtol=1e-5)
  np.testing.assert_allclose(m["train/grad_norm"], ref_metrics["train/grad_norm"], rtol=1e-5)
  np.testing.assert_allclose(m["policy/ratio_mean"], ref_metrics["policy/ratio_mean"], rtol=1e-6)
  assert m["policy/num_tokens"] == ref_metrics["policy/num_tokens"]
  scale = max(np.abs(x).max() for x in jax.tree.leaves(mu(ref_state["opt_state"])))
  assert_trees_close(mu(acc.opt_state), mu(ref_state["opt_state"]), atol=1e-5 * scale)
  assert_trees_close(acc.params, ref_state["params"], atol=1e-5)


@pytest.mark.devices(SHARDED_DEVICES)
def test_sharded_step_matches_single_device(model_params, fixed_batch, reference_run, shared_trainer):
  """3 steps on fsdp=4, and on fsdp=2 x tp=2 with 2 microbatches, give the single-device params."""
  fsdp4 = TrainerExecutor(CONFIG, fsdp_mesh(4), model_params[1], optimizer=OPT, loss_kwargs=LOSS_KW)
  runs = {"fsdp4": run_steps(fsdp4, fixed_batch, 3), "fsdp2_tp2_mb2": shared_trainer.first_steps}
  specs = {name: {str(x.sharding.spec) for x in jax.tree.leaves(t.params)}
           for name, t in [("fsdp4", fsdp4), ("fsdp2_tp2", shared_trainer)]}
  assert any("fsdp" in s for s in specs["fsdp4"]) and not any("tp" in s for s in specs["fsdp4"])
  assert any("fsdp" in s for s in specs["fsdp2_tp2"]) and any("tp" in s for s in specs["fsdp2_tp2"])
  for name, (metrics, states) in runs.items():
    for m, ref in zip(metrics, reference_run["metrics"]):
      np.testing.assert_allclose(m["loss/total"], ref["loss/total"], rtol=1e-5, err_msg=name)
    assert_trees_close(states[2]["params"], reference_run["states"][2]["params"], atol=1e-5)


def test_nan_advantage_skips_update_and_counts(shared_trainer):
  trainer = shared_trainer
  before_params, before_opt = host(trainer.params), host(trainer.opt_state)
  skipped, steps = int(trainer.state_dict()["skipped_nonfinite"]), trainer.num_steps
  m = trainer.step(make_batch(3, nan_row=2))
  assert m["train/skipped_nonfinite"] == skipped + 1 and m["train/update_applied"] == 0
  assert not np.isfinite(m["loss/total"])
  jax.tree.map(np.testing.assert_array_equal, host(trainer.params), before_params)  # bit-identical
  jax.tree.map(np.testing.assert_array_equal, host(trainer.opt_state), before_opt)
  m = trainer.step(make_batch(3))  # training continues from the untouched state
  assert m["train/skipped_nonfinite"] == skipped + 1 and m["train/update_applied"] == 1
  assert m["train/step"] == steps + 2
  after = host(trainer.params)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after))
  assert not np.array_equal(after["lm_head"], before_params["lm_head"])


def test_compiles_once_across_new_batches(shared_trainer):
  for seed in range(3):
    shared_trainer.step(make_batch(20 + seed))  # new tokens and lengths, same [B, P] / [B, R] bucket
  assert shared_trainer.trace_count == 1
  assert compat.jit_cache_size(shared_trainer.programs.train_step) == 1


def test_state_dict_roundtrip_resumes_identically(shared_trainer):
  """Loading a host snapshot of state_dict() and repeating a step reproduces it bit for bit."""
  trainer = shared_trainer
  saved = host(trainer.state_dict())  # what a checkpoint holds
  assert set(saved) == {"params", "opt_state", "step", "skipped_nonfinite"}
  first = trainer.step(make_batch(6))
  first_params = host(trainer.params)
  trainer.load_state_dict(saved)
  assert trainer.num_steps == saved["step"]
  again = trainer.step(make_batch(6))
  assert first["train/step"] == again["train/step"] == saved["step"] + 1
  assert first["train/lr"] == again["train/lr"]
  jax.tree.map(np.testing.assert_array_equal, host(trainer.params), first_params)
  assert trainer.trace_count == 1  # restored arrays carry the trainer's shardings: no recompile


@pytest.mark.slow
def test_bf16_compute_keeps_fp32_master_params(bf16_ppo_run, reference_run):
  """bf16 matmuls, fp32 master params: the first update matches the fp32 run's to bf16 precision.

  On-policy at the first step, PPO-clip's gradient equals AIPO's (ratio 1, no clipping) and the KL
  term's gradient is 0 (policy == reference), so the grad norm is comparable to the fp32 AIPO run.
  """
  m = bf16_ppo_run["metrics"][0]
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(bf16_ppo_run["states"][0]["params"]))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf16_ppo_run["trainer"].ref_params))
  assert m["train/update_applied"] == 1
  np.testing.assert_allclose(m["train/grad_norm"], reference_run["metrics"][0]["train/grad_norm"], rtol=5e-2)


@pytest.mark.slow
def test_ppo_clip_with_reference_kl(bf16_ppo_run, model_params):
  """The loss is chosen by name; a reference model on the same mesh adds a KL term (0 at the start)."""
  m0, m1 = bf16_ppo_run["metrics"]
  assert m0["policy/kl_ref"] == 0  # policy == reference (both bf16 casts of the same fp32 weights)
  assert m1["policy/kl_ref"] > 1e-6 and m1["loss/kl"] > 0
  assert "policy/frac_clipped" in m1 and "policy/frac_truncated" not in m1  # PPO's metrics, not AIPO's
  with pytest.raises(ValueError, match="unknown loss"):
    TrainerExecutor(CONFIG, one_device_mesh(), model_params[1], loss="decoupled_ppo")


@pytest.mark.slow
def test_sequence_level_correction_accumulates_exactly_over_microbatches(model_params):
  """MIS rejects whole sequences (a row never straddles microbatches): 4 microbatches give the
  one-batch loss and gradient norm, and the per-sequence rejection rate is weighted by sequences.

  Expected values come from `losses.mis_loss` on the full batch with the initial policy's log-probs;
  the batch's random behaviour log-probs put some sequences outside the band and some inside.
  """
  from llamarl_jax import losses

  graphdef, params = model_params
  batch = make_batch(2)  # behaviour log-probs uniform in [-5, -1]: off-policy
  kw = {"level": "geometric", "rs_threshold": 0.22, "rs_threshold_lower": 0.15}
  r = batch.rollout
  lp = logprobs_fn(graphdef, params, r.prompt_tokens, r.prompt_mask, r.response_tokens, r.response_mask,
                   temperature=1.0)[0]
  want_loss, want = losses.mis_loss(lp, r.behaviour_logprobs, batch.advantages, r.response_mask, **kw)
  frac = float(want["rollout_corr/rollout_rs_seq_masked_fraction"])
  assert 0 < frac < 1, frac  # the test needs both kinds of rows
  runs = [TrainerExecutor(CONFIG, one_device_mesh(), params, optimizer=OPT, loss="mis", loss_kwargs=kw,
                          microbatches=mb).step(batch) for mb in (1, 4)]
  for m in runs:
    np.testing.assert_allclose(m["loss/total"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_seq_masked_fraction"], frac, rtol=1e-6)
    np.testing.assert_allclose(m["rollout_corr/rollout_rs_masked_fraction"],
                               want["rollout_corr/rollout_rs_masked_fraction"], rtol=1e-6)
  np.testing.assert_allclose(runs[1]["train/grad_norm"], runs[0]["train/grad_norm"], rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# microbatches grouped by length

LONG_CONFIG = CONFIG.replace(max_position_embeddings=LONG_P + LONG_R)
ROWS_PER_MICROBATCH = 4  # what reaches <= 30% padding on the long tail (8 rows: ~35-45%)


def trainer_rows(batch: ScoredBatch) -> np.ndarray:
  """Each row's trainer length: real prompt tokens + response up to its last valid token."""
  r = batch.rollout
  return r.prompt_mask.sum(1) + r.response_mask.sum(1)  # responses here are contiguous from 0


def test_width_bucket_and_grouping_by_hand():
  """Widths: 4 rungs an octave from 16, capped. Rows sorted longest first (ties by index), cut into
  M groups; group m at positions j*M + m."""
  assert [width_bucket(n, 4096) for n in (1, 16, 17, 21, 33, 100, 1000, 1025)] == [16, 16, 20, 24, 40, 112, 1024, 1280]
  assert width_bucket(300, 272) == 272
  lengths = np.array([5, 40, 17, 17, 3, 100, 16, 2])
  g = group_by_length(lengths, 2, 128)
  # sorted: rows 5 (100), 1 (40), 2 (17), 3 (17), 6 (16), 0 (5), 4 (3), 7 (2) -> groups [5 1 2 3], [6 0 4 7]
  np.testing.assert_array_equal(g.order, [5, 6, 1, 0, 2, 4, 3, 7])
  assert g.widths == (112, 16)
  assert g.padding_fraction == pytest.approx((4 * (112 + 16) - 200) / 200)  # 1.56
  # the trainer's microbatch split of the grouped batch (position j*M + m -> microbatch m) gives the groups
  np.testing.assert_array_equal(g.order.reshape(4, 2).T, [[5, 1, 2, 3], [6, 0, 4, 7]])


def test_grouping_cuts_padding_below_30_percent_on_the_long_tail():
  """64 rows like bench_generate's longtail (responses geometric, mean 32, max/mean 5.8; prompts 4..16):
  every row padded to 16 + 256 is ~6 padded positions per real token; 16 microbatches of 4 rows, each
  at its own width, 25%. The trainer reports this function's value (test_grouped_step_equals_ungrouped)."""
  batch = long_tail_batch(2)
  lengths = trainer_rows(batch)
  responses = batch.rollout.response_mask.sum(1)
  assert 5.5 < responses.max() / responses.mean() < 6.5  # the workload's shape (bench_generate: 6.1)
  real = lengths.sum()
  assert (64 * (LONG_P + LONG_R) - real) / real == pytest.approx(6.11, abs=0.01)
  grouped = group_by_length(lengths, 64 // ROWS_PER_MICROBATCH, LONG_P + LONG_R)
  assert grouped.padding_fraction == pytest.approx(0.248, abs=1e-3) and grouped.padding_fraction <= 0.30
  assert group_by_length(lengths, 8, LONG_P + LONG_R).padding_fraction > 0.30  # 8 rows a microbatch: 45%


@pytest.fixture(scope="module")
def grouped_runs(model_params):
  """A long-tail batch of 32 rows (responses geometric, mean 32, capped at 256; max/mean 4.3) in 8
  microbatches, 2 steps: ungrouped (the fused step) on one device, grouped by length on fsdp=2 (or
  fewer devices). AIPO with an entropy bonus and a KL to the initial policy, aggregated by Dr. GRPO's
  seq_sum_norm: the normaliser a grouped step could get wrong (microbatch shares by sequences, not
  tokens; the default constant is the batch's padded response length R, not a narrower microbatch's;
  token_mean shares are the same code, `_loss_share`)."""
  batch = long_tail_batch(3, rows=32)
  kw = dict(optimizer=OPT, loss_kwargs={"rho_max": 2.0, "entropy_coef": 0.01, "aggregation": "seq_sum_norm"},
            microbatches=32 // ROWS_PER_MICROBATCH, ref_params=model_params[1], kl_coef=0.1)
  runs = {}
  for name, mesh, kind in [("ungrouped", one_device_mesh(), "padded"), ("grouped", mesh_at_most(fsdp=2), "grouped")]:
    trainer = TrainerExecutor(LONG_CONFIG, mesh, model_params[1], layout=TrainLayout(kind), **kw)
    metrics, states = run_steps(trainer, batch, 2)
    runs[name] = {"metrics": metrics, "states": states, "trainer": trainer}
  return batch, runs


@pytest.mark.timeout(900)  # 12 programs to compile: minutes on 2 busy CPU cores
@pytest.mark.slow
def test_grouped_step_equals_ungrouped(grouped_runs):
  """The same loss, metrics, gradient and update with the rows grouped by length: each microbatch's
  loss is weighted by its share of the whole batch's sequences, whichever rows it holds. Step 2
  is off-policy (ratios != 1) with a non-zero KL. Metrics are means and sums over the same tokens in
  another order: 1e-5 relative (atol 1e-9 for KL terms of ~1e-7). train/padding_fraction is what each
  step computes: 6.5 padded positions per real token ungrouped, 21.6% grouped."""
  batch, runs = grouped_runs
  grouped, ungrouped = runs["grouped"], runs["ungrouped"]
  for g, u in zip(grouped["metrics"], ungrouped["metrics"]):
    assert set(g) == set(u)
    for k in sorted(set(g) - {"time/train_step", "train/padding_fraction"}):
      np.testing.assert_allclose(g[k], u[k], rtol=1e-5, atol=1e-9, err_msg=k)
  assert grouped["metrics"][1]["policy/kl_ref"] > 0 and grouped["metrics"][1]["policy/ratio_max"] > 1
  for g, u in zip(grouped["states"], ungrouped["states"]):
    scale = max(np.abs(x).max() for x in jax.tree.leaves(mu(u["opt_state"])))
    assert_trees_close(mu(g["opt_state"]), mu(u["opt_state"]), atol=1e-5 * scale)
    assert_trees_close(g["params"], u["params"], atol=1e-5)
  lengths = trainer_rows(batch)
  real = lengths.sum()
  np.testing.assert_allclose(ungrouped["metrics"][0]["train/padding_fraction"], (32 * (LONG_P + LONG_R) - real) / real,
                             rtol=1e-6)
  groups = group_by_length(lengths, 32 // ROWS_PER_MICROBATCH, LONG_P + LONG_R)
  assert max(groups.widths) < LONG_R  # every microbatch cut: seq_sum_norm's R must come from the batch
  assert grouped["metrics"][0]["train/padding_fraction"] == pytest.approx(groups.padding_fraction)
  assert ungrouped["metrics"][0]["train/padding_fraction"] > 6 and grouped["metrics"][0]["train/padding_fraction"] < 0.3


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_grouped_compiles_one_program_per_width(grouped_runs):
  """Batches with other length mixes compile only the widths not seen yet: one microbatch program per
  width, the lengths, prepare and apply programs once each. Every width is a rung of the ladder (18
  rungs up to 16 + 256: the bound on programs whatever the lengths). Here the fixture's batch uses 8
  widths, a batch of shorter rows (mean response 16) only widths already compiled, a third adds one
  (160)."""
  batch, runs = grouped_runs
  trainer = runs["grouped"]["trainer"]
  M = 32 // ROWS_PER_MICROBATCH
  widths = set(group_by_length(trainer_rows(batch), M, LONG_P + LONG_R).widths)
  assert len(widths) == 8
  for seed, new_widths in [(41, 0), (24, 1)]:
    new = long_tail_batch(seed, 16, rows=32)
    seen = len(widths)
    widths |= set(group_by_length(trainer_rows(new), M, LONG_P + LONG_R).widths)
    assert len(widths) == seen + new_widths
    trainer.step(new)
    assert compat.jit_cache_size(trainer.programs.accumulate_step) == len(widths)
  rungs = {width_bucket(n, LONG_P + LONG_R) for n in range(1, LONG_P + LONG_R + 1)}
  assert widths <= rungs and len(rungs) == 18
  programs = trainer.programs
  assert [compat.jit_cache_size(f) for f in (programs.row_lengths, programs.prepare_step, programs.apply_step)] == [1, 1, 1]
  assert trainer.trace_count == 3 + len(widths)
  assert compat.jit_cache_size(trainer.programs.train_step) == 0  # the fused step is not used
