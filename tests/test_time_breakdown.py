"""Where the time goes: a step's `time/*` parts sum to its `time/step`, and a whole run's breakdown
(warm-up, SFT, generation, rewards, training, weight push, evaluation, checkpoints, waits) sums to its
wall time. The run is configs/llama3_1b_1gpu.gin (the one-GPU config, colocated, slot engine, bf16
generator) at a reduced size, so the test also runs that config's steps on a CPU."""

import json
from pathlib import Path

import gin
import pytest

from llamarl_jax.time_breakdown import PARTS, STEP_PARTS, TimeBreakdown, format_breakdown, overlap_seconds, split_wait

ROOT = Path(__file__).resolve().parents[1]


def test_split_wait_counts_each_instant_once_in_precedence_order():
  """[0, 10]: generate 1-4, swap 3-5 (3-4 is the generator's), reward 2-7 (its own 5-7), nothing 0-1 and 7-10."""
  intervals = [("generate", 1.0, 4.0), ("swap", 3.0, 5.0), ("reward", 2.0, 7.0), ("train", 0.0, 10.0),
               ("generate", -5.0, -1.0)]  # other kinds and intervals outside the wait are ignored
  out = split_wait(0.0, 10.0, intervals)
  assert out == pytest.approx({"time/wait_generate": 3.0, "time/wait_swap": 1.0, "time/wait_reward": 2.0,
                               "time/wait_other": 4.0}, abs=1e-12)
  assert split_wait(2.0, 2.0, intervals) == {"time/wait_generate": 0.0, "time/wait_swap": 0.0,
                                             "time/wait_reward": 0.0, "time/wait_other": 0.0}


def test_the_first_step_is_warm_up_and_the_rest_is_split():
  b = TimeBreakdown()
  step = {"time/step": 6.0, **{k: 1.0 for k in STEP_PARTS}}
  b.add_step(step)
  b.add_step(step)
  assert b.seconds["warmup"] == 6.0
  assert b.seconds["weight_sync"] == 2.0 and b.seconds["training"] == 1.0  # time/sync + time/wait_swap
  r = b.report(20.0)
  assert r["unaccounted_seconds"] == pytest.approx(20.0 - 12.0) and r["parts"]["warmup"]["share"] == 6.0 / 20.0
  assert b.blocks == 0  # steps are not blocks between steps; a checkpoint is (a runner restarts its step clock)
  with b.timed("checkpointing"):
    pass
  assert b.blocks == 1


def test_a_block_timed_inside_another_counts_once_in_the_inner_part(tmp_path):
  """SFT's logging: the outer block's seconds less the inner's; the metrics logger times its writes."""
  import time

  from llamarl_jax.metrics import MetricsLogger

  b = TimeBreakdown()
  logger = MetricsLogger(tmp_path, tensorboard=False, breakdown=b)
  with b.timed("sft"):
    time.sleep(0.02)
    with b.timed("logging"):
      time.sleep(0.03)
    logger.log(1, {"sft/nll": 1.0})
  logger.close()
  assert b.seconds["logging"] >= 0.03 and 0.02 <= b.seconds["sft"] < 0.03 + 0.01
  assert b.blocks == 3 and b.report(1.0)["unaccounted_seconds"] == pytest.approx(1.0 - b.seconds["sft"]
                                                                                 - b.seconds["logging"])


def test_overlap_is_the_seconds_two_kinds_of_work_ran_at_once():
  timeline = [("generate", 0.0, 2.0), ("reward", 1.0, 4.0), ("generate", 3.0, 5.0), ("train", 4.5, 6.0),
              ("generate", 1.5, 2.5)]  # a second generator thread: generation is [0, 2.5] and [3, 5]
  assert overlap_seconds(timeline, "reward", "generate") == pytest.approx(1.5 + 1.0)
  assert overlap_seconds(timeline, "generate", "train") == pytest.approx(0.5)
  assert overlap_seconds(timeline, "reward", "train") == 0.0
  report = TimeBreakdown().report(10.0, timeline)
  assert report["overlap_seconds"] == pytest.approx({"rewards with generation": 2.5, "generation with training": 0.5,
                                                     "rewards with training": 0.0})
  assert "at the same time: rewards with generation 2.5 s" in format_breakdown(report)


REDUCED = [  # the one-GPU config at a size a CPU test runs; the config's other settings kept
    "ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
    "ModelConfig.num_heads = 4", "ModelConfig.num_kv_heads = 2", "ModelConfig.head_dim = 8",
    "build_policy.vocab_size = 160",  # past the char tokenizer's 100: ids that decode to nothing
    "RolloutConfig.prompts_per_step = 2", "RolloutConfig.samples_per_prompt = 4", "RolloutConfig.max_new_tokens = 8",
    "GeneratorConfig.slots = 8", "GeneratorConfig.max_prompt_len = 16", "TrainConfig.microbatches = 2",
    "run_experiment.rl_steps = 4", "run_experiment.progress = False", "run_experiment.tensorboard = False",
    # synchronous (lag 0): the trainer waits for each batch's generation and rewards; an emulated 0.1 s
    # more generation per batch outlasts its logging of the step before (a part of its own), so it waits
    "ScheduleConfig.max_policy_lag = 0", "GeneratorConfig.delay_s = 0.1",
    # evaluations, checkpoints, the export: their parts of the breakdown (the SFT's is a timed block too)
    "run_experiment.eval_size = 8", "run_experiment.eval_every = 2", "TrainConfig.checkpoint_every = 2",
    "run_experiment.export = True",
    # Weights & Biases offline beside JSONL: the run's config, rows, breakdown and plan (test below)
    "run_experiment.wandb_project = 'llamarl-test'", "run_experiment.wandb_mode = 'offline'",
]


@pytest.fixture(scope="module")
def one_gpu_run(tmp_path_factory):
  from llamarl_jax import experiment

  run_dir = tmp_path_factory.mktemp("one_gpu") / "run"
  gin.clear_config()
  try:
    experiment.parse_gin([str(ROOT / "configs" / "llama3_1b_1gpu.gin")],
                         REDUCED + [f"run_experiment.run_dir = '{run_dir}'"])
    summary = experiment.run_experiment()
  finally:
    gin.clear_config()
  return run_dir, summary


@pytest.mark.slow  # a whole run (~1 min on 2 cores, mostly compiling)
def test_the_one_gpu_config_runs_its_steps_at_reduced_size(one_gpu_run):
  run_dir, summary = one_gpu_run
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]
  assert summary["policy_lag_max"] <= 1 and summary["model_params"] > 0
  assert json.loads((run_dir / "summary.json").read_text())["time_breakdown"] == summary["time_breakdown"]


@pytest.mark.slow  # a whole run (~1 min on 2 cores, mostly compiling)
def test_each_steps_time_parts_sum_to_the_step(one_gpu_run):
  run_dir, _ = one_gpu_run
  steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  steps = [r for r in steps if "reward/mean" in r]
  waits = ("time/wait_generate", "time/wait_swap", "time/wait_reward", "time/wait_other")
  for r in steps:  # exact up to float rounding: the parts are differences of the same clock readings
    assert sum(r[k] for k in STEP_PARTS) == pytest.approx(r["time/step"], rel=1e-9, abs=1e-9), r["step"]
    assert sum(r[k] for k in waits) == pytest.approx(r["time/trainer_wait"], rel=1e-9, abs=1e-9)
    assert all(r[k] >= 0 for k in STEP_PARTS)
  # synchronous: the trainer waits for batches' generation and rewards (not after an evaluation, during
  # which the next batch was generated)
  assert sum(r["time/wait_generate"] for r in steps[1:]) > 0 and sum(r["time/wait_reward"] for r in steps[1:]) > 0


@pytest.mark.slow  # a whole run (~1 min on 2 cores, mostly compiling)
def test_the_breakdown_adds_up_to_the_wall_time(one_gpu_run):
  """Every part measured where it happens; what none measured (logging, summaries) is within 5% of
  the wall time."""
  _, summary = one_gpu_run
  b = summary["time_breakdown"]
  assert list(b["parts"]) == list(PARTS)
  assert b["wall_seconds"] == pytest.approx(summary["total_seconds"])
  total = sum(p["seconds"] for p in b["parts"].values())
  assert abs(b["wall_seconds"] - total) <= 0.05 * b["wall_seconds"], b
  assert sum(p["share"] for p in b["parts"].values()) == pytest.approx(1.0, abs=0.05)
  for part in ("warmup", "generation", "rewards", "training", "weight_sync", "evaluation", "checkpointing"):
    assert b["parts"][part]["seconds"] > 0, part
  assert b["parts"]["sft"]["seconds"] == 0.0  # the config has no SFT warm start


@pytest.mark.slow  # a whole run (~1 min on 2 cores, mostly compiling)
def test_wandb_offline_holds_the_runs_config_rows_breakdown_and_plan(one_gpu_run):
  """Read back from W&B's own log file: the configuration the checkpoints record (and the gin text),
  each RL step's row as in metrics.jsonl, and the summary's time breakdown and memory plan."""
  from wandb_records import run_contents

  run_dir, summary = one_gpu_run
  run = run_contents(run_dir)
  assert run["config"]["model"]["num_layers"] == 2 and "ModelConfig.hidden_size = 32" in run["config"]["gin"]
  jsonl = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
           if "reward/mean" in r}
  logged = {h["_step"]: h for h in run["history"] if "reward/mean" in h}
  assert sorted(logged) == sorted(jsonl) == [1, 2, 3, 4]
  for step, row in logged.items():
    assert row["reward/mean"] == pytest.approx(jsonl[step]["reward/mean"], rel=1e-12)
    assert row["time/step"] == pytest.approx(jsonl[step]["time/step"], rel=1e-12)
  b, plan = summary["time_breakdown"], summary["memory_plan"]
  assert run["summary"]["time_breakdown/wall_seconds"] == pytest.approx(b["wall_seconds"])
  assert run["summary"]["time_breakdown/parts/generation/seconds"] == pytest.approx(b["parts"]["generation"]["seconds"])
  # colocated: one total, trainer and generator on the same device
  assert run["summary"]["memory_plan/totals/trainer + generator"] == pytest.approx(plan["totals"]["trainer + generator"])


@pytest.mark.devices(2)
@pytest.mark.slow
def test_a_synchronous_runs_generation_part_is_the_engines_own_time(tmp_path):
  """Lag 0: the trainer waits for each batch while the slot engine generates it, so the step parts'
  generation (`time/wait_generate`, the trainer's wait split by the generator's timeline) equals the
  seconds the engine spent in its own `step` calls, timed here by a clock wrapped around them, over
  the same steps (within 5%: the host work between the engine's calls and the step boundaries). The
  generator's busy seconds hold that and its host work."""
  import time

  from flax import nnx

  from llamarl_jax.config import run_config
  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.executors.reward import RewardExecutor
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.tokenizer import make_char_tokenizer

  tok = make_char_tokenizer()
  model = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
  _, params = split_params(Llama(model, rngs=nnx.Rngs(params=0)))
  run = run_config(max_policy_lag=0, prompts_per_step=4, samples_per_prompt=4, max_new_tokens=24,
                   engine_chunk_steps=2, seed=0)
  c = Controller(model, params, tok, PromptSource(task="arithmetic", seed=0), run_dir=tmp_path, config=run,
                 reward=RewardExecutor("arithmetic", inline=True), progress=False)
  engine_calls, step_ends = [], []
  engine = c.ex.generator.engine
  step = engine.step

  def timed_step():
    t0 = time.perf_counter()
    out = step()
    engine_calls.append((t0, time.perf_counter()))
    return out

  engine.step = timed_step
  try:
    steps = c.run(5, on_step=lambda s, m: step_ends.append(time.perf_counter()))
  finally:
    c.close()
  # steps 2..5 (the first one also waits for the trainer's and the push's compiles), by their end times
  engine_s = sum(b - a for a, b in engine_calls if step_ends[0] < a and b <= step_ends[-1])
  waited = sum(m["time/wait_generate"] for m in steps[1:])
  assert engine_s > 0.05
  assert waited == pytest.approx(engine_s, rel=0.05), (waited, engine_s)
  assert sum(m["time/generate_busy"] for m in steps[1:]) >= 0.95 * engine_s
