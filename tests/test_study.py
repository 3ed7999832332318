"""Periodic held-out evaluation during RL, and the statistics of the learning-quality study.

The evaluation runs between steps on the controller thread while the generator keeps going; under the
'fixed' version schedule it must not change a single trained number. The study's statistics are checked
against values computed by hand (the t quantile against the printed table value), and its report code
(table, comparisons, plots) on a few synthetic runs: no grid is run here (`scripts/study.py` does that).
"""

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from llamarl_jax import stats
from llamarl_jax.controller import Controller, schedule_metrics
from llamarl_jax.data import PromptSource
from llamarl_jax.executors.reward import RewardExecutor
from llamarl_jax.config import OptimizerConfig, run_config
from llamarl_jax.experiment import run_with_evals
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import Llama, split_params
from llamarl_jax.tokenizer import make_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def _study_module():
  spec = importlib.util.spec_from_file_location("study_script", ROOT / "scripts" / "study.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


# ------------------------------------------------------------------------------------------------
# periodic evaluation


@pytest.fixture(scope="module")
def setup():
  from flax import nnx

  tokenizer = make_char_tokenizer()
  config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  # 4 problems: greedy and 2 sampled draws each (this test is mostly compile time: keep shapes small).
  examples = PromptSource(task="arithmetic", seed=0).heldout().next_batch(4)
  return config, params, tokenizer, examples


def _controller(setup, run_dir):
  config, params, tokenizer, _ = setup
  run = run_config(reward_fn="arithmetic", max_policy_lag=1, prompts_per_step=4,
                   samples_per_prompt=2, max_new_tokens=4, trainer_fsdp=1, generator_dp=1,
                   optimizer=OptimizerConfig(lr=1e-2), seed=3, step_timeout_s=120)
  return Controller(config, params, tokenizer, PromptSource(task="arithmetic", seed=0), run_dir=run_dir, config=run,
                    reward=RewardExecutor("arithmetic", inline=True), progress=False)


@pytest.mark.devices(2)
@pytest.mark.slow
def test_evaluation_between_steps_leaves_training_unchanged(setup, tmp_path):
  """3 steps with an evaluation after each, then the same 3 steps again from a step-0 checkpoint
  without evaluations (one controller: its compiled functions serve both runs): identical metrics."""
  examples = setup[3]
  c = _controller(setup, tmp_path)
  evals = []
  try:
    with pytest.raises(ValueError, match="samples .* must be >= 0"):
      c.evaluate(examples, samples=-1)
    c.state = c.state.replace(data_state=c.prompt_source.state_dict())  # the restore point: step 0, its data position
    c.recorder.save(c.state)  # the checkpoint every step's save writes
    steps = run_with_evals(c, examples, 3, eval_every=1, samples=2, evals=evals)
    again = c.evaluate(examples, samples=2, seed=3)  # the weights after step 3, outside the run
    assert c.restore_checkpoint(0) == 0
    reference = c.run(3)
  finally:
    c.close()
  assert [schedule_metrics(m) for m in steps] == [schedule_metrics(m) for m in reference]
  assert [e["step"] for e in evals] == [1, 2, 3]
  for e in evals:
    assert 0.0 <= e["eval/accuracy"] <= 1.0 and 0.0 <= e["eval/pass1_sampled"] <= 1.0
    # 4 problems x 2 draws: the sampled pass@1 is a multiple of 1/8, the greedy accuracy of 1/4
    assert abs(e["eval/pass1_sampled"] * 8 - round(e["eval/pass1_sampled"] * 8)) < 1e-9
    assert abs(e["eval/accuracy"] * 4 - round(e["eval/accuracy"] * 4)) < 1e-9
  # An evaluation is a pure function of (weights, seed): the seed of the step-3 pass was 3.
  assert again["eval/accuracy"] == evals[-1]["eval/accuracy"]
  assert again["eval/pass1_sampled"] == evals[-1]["eval/pass1_sampled"]


# ------------------------------------------------------------------------------------------------
# statistics


def test_t_interval_matches_the_hand_computed_value():
  # values 1..5: mean 3, sample sd sqrt(2.5); t(0.975, df=4) = 2.776 in every printed t table, so the
  # half-width is 2.776 * sqrt(2.5) / sqrt(5) = 1.963. The table value has 4 digits: tolerance 1e-3.
  iv = stats.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
  assert iv.mean == 3.0 and iv.n == 5
  assert iv.sd == pytest.approx(math.sqrt(2.5), rel=1e-12)
  assert iv.half_width == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5), abs=1e-3)
  assert (iv.low, iv.high) == pytest.approx((3.0 - 1.963, 3.0 + 1.963), abs=1e-3)
  # n = 2: t(0.975, 1) = 12.706; values 0 and 2: sd sqrt(2), half-width 12.706 * sqrt(2) / sqrt(2)
  assert stats.t_interval([0.0, 2.0]).half_width == pytest.approx(12.706, abs=1e-3)
  # 90%: t(0.95, 4) = 2.132
  assert stats.t_interval([1, 2, 3, 4, 5], 0.90).half_width == pytest.approx(2.132 * math.sqrt(0.5), abs=1e-3)


def test_t_interval_edge_cases():
  assert math.isinf(stats.t_interval([0.7]).half_width) and stats.t_interval([0.7]).mean == 0.7
  same = stats.t_interval([0.5, 0.5, 0.5])
  assert same.half_width == 0.0 and same.low == same.high == 0.5
  with pytest.raises(ValueError, match="NaN"):
    stats.t_interval([1.0, float("nan")])
  with pytest.raises(ValueError, match="confidence"):
    stats.t_interval([1.0, 2.0], confidence=95)


def test_paired_interval_is_the_interval_of_per_seed_differences():
  a, b = [10.0, 12.0, 11.0, 15.0], [9.0, 10.0, 11.0, 12.0]  # differences 1, 2, 0, 3: mean 1.5
  iv = stats.paired_t_interval(a, b)
  sd = math.sqrt(((1 - 1.5) ** 2 + (2 - 1.5) ** 2 + (0 - 1.5) ** 2 + (3 - 1.5) ** 2) / 3)  # 1.291
  assert iv.mean == 1.5 and iv.sd == pytest.approx(sd)
  assert iv.half_width == pytest.approx(3.182 * sd / 2, abs=1e-3)  # t(0.975, 3) = 3.182
  with pytest.raises(ValueError, match="same seeds"):
    stats.paired_t_interval([1.0, 2.0], [1.0])


def test_curve_summaries():
  r = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
  assert stats.curve_area(r) == pytest.approx(0.5)
  np.testing.assert_allclose(stats.moving_average(r, 3), [0.0, 0.1, 0.2, 0.4, 0.6, 0.8])
  assert stats.steps_to_threshold(r, 0.6) == 4            # the first step with reward >= 0.6
  assert stats.steps_to_threshold(r, 0.5, window=3) == 5  # trailing 3-step means from step 3: 0.2, 0.4, 0.6
  assert stats.steps_to_threshold([0.9, 0.0, 0.0], 0.5, window=2) is None  # one early spike does not count
  assert stats.steps_to_threshold(r, 1.1) is None
  assert stats.window_mean([0.1, 0.5, 0.7, 0.9], 3) == pytest.approx(0.7)


# ------------------------------------------------------------------------------------------------
# the study's report (synthetic runs, no training)


def _fake_result(cell, seed, level, steps=20):
  rng = np.random.default_rng(seed)
  reward = np.clip(np.linspace(0.2, level, steps) + rng.normal(0, 0.02, steps), 0, 1)
  nan = [math.nan] * steps
  return {"cell": cell, "seed": seed, "steps": {
      "reward/mean": reward.tolist(), "policy/kl_behaviour": [0.01 * level] * steps,
      "policy/frac_truncated": [0.001] * steps, "policy/frac_clipped": nan, "time/step": [0.3] * steps},
      "evals": [{"step": 0, "eval/accuracy": 0.0, "eval/pass1_sampled": 0.0}]
      + [{"step": s, "eval/accuracy": level + 0.01 * seed, "eval/pass1_sampled": level - 0.1} for s in (10, 15, 20)]}


def test_study_report_tables_and_verdicts(tmp_path):
  study = _study_module()
  results = {"lag0": [_fake_result("lag0", s, 0.8) for s in range(4)],
             "lag1": [_fake_result("lag1", s, 0.795) for s in range(4)]}
  table = study.summarise(results, eval_window=3, threshold=0.7, threshold_window=2, rl_steps=20)
  # held-out: the last 3 evaluations of seed s are all 0.8 + 0.01 s -> mean over seeds 81.5 points
  assert table["lag0"]["heldout"]["mean"] == pytest.approx(81.5)
  assert table["lag0"]["heldout"]["half_width"] == pytest.approx(
      stats.t_interval([80.0, 81.0, 82.0, 83.0]).half_width)
  d = study.compare(table, "lag1", "lag0", "heldout")  # per seed exactly -0.5 points
  assert d["mean"] == pytest.approx(-0.5) and d["half_width"] == pytest.approx(0.0, abs=1e-9)
  assert study.verdict(d, margin=2.0).startswith("yes")
  assert study.verdict({"low": -3.0, "high": 1.0}, margin=2.0).startswith("not separable")
  assert study.verdict({"low": -5.0, "high": -2.5}, margin=2.0).startswith("no")
  assert study.verdict({"low": 0.1, "high": 2.0}) == "first is higher (better)"
  assert study.verdict({"low": 0.1, "high": 2.0}, better="lower") == "first is higher (worse)"  # e.g. step time
  assert study.verdict({"low": -2.0, "high": -0.1}, better="lower") == "first is lower (better)"
  assert study.verdict({"low": -0.1, "high": 2.0}).startswith("not separable")
  md = study.markdown(table, [], knobs={"eval_window": 3, "eval_size": 8, "eval_every": 5, "rl_steps": 20,
                                       "eval_samples": 2}, threshold=0.7, threshold_window=2,
                      before={"eval/accuracy": 0.0, "eval/pass1_sampled": 0.0})
  assert "| lag 1, AIPO detached rho 2 | 4 | 81.0 ± 2.1 |" in md  # 79.5 + 1.5; t(0.975, 3) sd / 2 = 2.05
  pytest.importorskip("matplotlib")
  paths = study.plots(results, table, tmp_path, smooth=3, knobs={"eval_window": 3})
  assert [p.name for p in paths] == ["study_reward_curves.png", "study_heldout.png", "study_heldout_curves.png",
                                     "study_kl_vs_lag.png"]
  assert all(p.stat().st_size > 10_000 for p in paths)
  json.dumps(table)  # the JSON report holds plain numbers


def test_runs_that_never_reach_the_threshold_count_as_the_budget():
  study = _study_module()
  results = {"lag0": [_fake_result("lag0", s, 0.8) for s in range(3)],
             "lag1": [_fake_result("lag1", s, 0.5) for s in range(3)]}  # the reward never reaches 0.7
  table = study.summarise(results, eval_window=3, threshold=0.7, threshold_window=2, rl_steps=20)
  hits = table["lag0"]["steps_to_threshold"]["values"]
  assert all(h is not None and h < 20 for h in hits) and table["lag0"]["steps_to_threshold"]["reached"] == 3
  assert table["lag1"]["steps_to_threshold"]["values"] == [None] * 3
  assert table["lag1"]["steps_to_threshold"]["mean"] == 20 and table["lag1"]["steps_to_threshold"]["reached"] == 0
  d = study.compare(table, "lag1", "lag0", "steps_to_threshold")  # paired on the censored values
  assert d["mean"] == pytest.approx(20 - np.mean(hits))


def test_off_policy_cells_are_opt_in_and_report_their_rejected_fraction():
  """The off-policy grid's cells are selectable but not part of the default study (whose recorded settings stay
  unchanged); an MIS run's rejected-token fraction is what the table's dropped/clipped column shows."""
  study = _study_module()
  assert set(study.OFF_POLICY_CELLS).isdisjoint(study.CELLS) and len(study.OFF_POLICY_CELLS) == 20
  assert study._parse([]).cells == list(study.CELLS)
  assert study._parse(["--cells", "lag0,op_lag8_gspo_dyn"]).cells == ["lag0", "op_lag8_gspo_dyn"]
  assert study._parse(["--cells", "offpolicy"]).cells == list(study.OFF_POLICY_CELLS)  # `make study-offpolicy`
  assert study.OFF_POLICY_CELLS["op_lag8_gspo_dyn"][1]["dynamic_sampling"] == {"max_draws": 4}
  r = _fake_result("op_lag4_mis", 0, 0.8)
  r["steps"]["policy/frac_truncated"] = [math.nan] * 20
  r["steps"]["rollout_corr/rollout_rs_masked_fraction"] = [0.25] * 20
  scalars = study.run_scalars(r, eval_window=3, threshold=0.7, threshold_window=2)
  assert scalars["frac_truncated"] == pytest.approx(0.25)
  old = study.run_scalars(_fake_result("lag1", 0, 0.8), eval_window=3, threshold=0.7, threshold_window=2)
  assert old["frac_truncated"] == pytest.approx(0.001)  # a result without the rollout_corr keys: its policy/frac_truncated
  import gin

  from llamarl_jax import experiment  # noqa: F401  (registers the configurables _settings reads)

  gin.clear_config()
  try:
    default = study._settings(study.CELLS)
    assert set(default) == {"bindings", "cells"} and set(default["cells"]) == set(study.CELLS)
    assert study._settings(["lag0", "op_lag4_mis"])["off_policy_cells"].keys() == {"op_lag4_mis"}
  finally:
    gin.clear_config()


def test_off_policy_report_questions_drop_rate_and_plots(tmp_path):
  """The off-policy grid's report: the dropped-group rate of dynamic-sampling cells (NaN-free mean of
  the per-step rates), the paired objective-vs-AIPO and dynamic-vs-not comparisons, and its figures."""
  study = _study_module()
  results = {}
  for cell, level, drop in (("op_lag4_aipo", 0.8, None), ("op_lag4_gspo", 0.7, None), ("op_lag4_gspo_dyn", 0.75, 0.3)):
    results[cell] = []
    for s in range(3):
      r = _fake_result(cell, s, level)
      if drop is not None:
        r["steps"]["dynamic_sampling/drop_rate"] = [drop] * 10 + [math.nan] + [drop + 0.1] * 9
      results[cell].append(r)
  table = study.summarise(results, eval_window=3, threshold=0.7, threshold_window=2, rl_steps=20)
  assert table["op_lag4_gspo_dyn"]["drop_rate"]["mean"] == pytest.approx((10 * 0.3 + 9 * 0.4) / 19)
  assert table["op_lag4_aipo"]["drop_rate"]["n"] == 0
  asked = {(a, b, k) for a, b, k, _, _ in study.QUESTIONS}
  assert ("op_lag4_gspo", "op_lag4_aipo", "heldout") in asked and ("op_lag8_mis_dyn", "op_lag8_mis", "auc") in asked
  d = study.compare(table, "op_lag4_gspo", "op_lag4_aipo", "heldout")  # per seed exactly -10 points
  assert d["mean"] == pytest.approx(-10.0) and study.verdict(d) == "first is lower (worse)"
  md = study.markdown(table, [], knobs={"eval_window": 3, "eval_size": 8, "eval_every": 5, "rl_steps": 20,
                                       "eval_samples": 2}, threshold=0.7, threshold_window=2,
                      before={"eval/accuracy": 0.0, "eval/pass1_sampled": 0.0})
  assert "| 0.347 ± " in md and "groups dropped" in md
  pytest.importorskip("matplotlib")
  paths = study.plots(results, table, tmp_path, smooth=3, knobs={"eval_window": 3})
  assert [p.name for p in paths] == ["study_offpolicy_reward_curves.png", "study_offpolicy_summary.png"]
  assert all(p.stat().st_size > 10_000 for p in paths)


def _seeds_script():
  spec = importlib.util.spec_from_file_location("seeds_script", ROOT / "scripts" / "seeds.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_seeds_report_gives_each_arms_t_interval_and_the_paired_difference():
  """scripts/seeds.py's table from per-run results: arm A after RL 0.90, 0.94, 0.98 -> mean 94.0 and
  half-width t(0.975, 2) * 4 / sqrt(3) = 4.303 * 2.309 = 9.9; arm B 2 points above A in every seed:
  paired difference +2.0 ± 0.0."""
  seeds = _seeds_script()
  assert seeds.parse_arm("lora8=configs/tiny_lora.gin,LoraConfig.rank=8") == (
      "lora8", "configs/tiny_lora.gin", ["LoraConfig.rank=8"])
  with pytest.raises(SystemExit, match="NAME=FILE.gin"):
    seeds.parse_arm("configs/tiny_cpu.gin")
  row = lambda arm, seed, after: {"arm": arm, "seed": seed, "eval_before_rl": 0.0, "eval_after_rl": after,  # noqa: E731
                                  "eval_accuracy_window": after, "rl_seconds": 100.0, "wall_seconds": 500.0}
  rows = [row("a", s, v) for s, v in enumerate((0.90, 0.94, 0.98))]
  rows += [row("b", s, v + 0.02) for s, v in enumerate((0.90, 0.94, 0.98))]
  text = seeds.report(rows, ["a", "b"])
  assert "| a | 3 | 0.0 ± 0.0 (0.0-0.0) | 94.0 ± 9.9 (90.0-98.0) |" in text
  assert "b - a, held-out after RL, paired over seeds [0, 1, 2]: +2.0 ± 0.0 points" in text
