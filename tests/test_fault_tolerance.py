"""Kill -9 at the worst moments, then --resume: nothing is lost that a checkpoint holds, nothing is
logged twice, and a 'fixed'-schedule run ends exactly where an uninterrupted run ends.

Each run is `scripts/train.py` in a fresh interpreter (tests/fault_child.py), under a hard timeout,
SIGKILLing itself at a chosen point: tiny Llama, arithmetic task, lag 1, 'fixed' schedule, a
checkpoint every 2 steps, 6 RL steps, rewards in a worker process. The interpreters share a JAX
compilation cache, so only the first one compiles.

  uninterrupted:  steps 1..6
  interrupted:    steps 1..4, killed while saving checkpoint 4 (arrays written, manifest not yet)
                  --resume: checkpoint 4 is incomplete -> reported, set aside; resumes from 2;
                            steps 3, 4 (checkpoint 4 saved), killed in the middle of step 5
                  --resume: resumes from 4; steps 5, 6
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import gin
import pytest

from llamarl_jax import compat
from llamarl_jax.checkpoint import MANIFEST, IncompatibleCheckpoint, latest_complete_step
from llamarl_jax.controller import schedule_metrics

ROOT = Path(__file__).resolve().parents[1]
TRAIN_ARGS = ["--gin_file", str(ROOT / "configs" / "tiny_cpu.gin")] + [f"--gin_param={b}" for b in (
    "ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
    "run_experiment.sft = False", "run_experiment.eval_size = 4", "run_experiment.export = False",
    "run_experiment.tensorboard = False", "run_experiment.progress = False", "run_experiment.rl_steps = 6",
    "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 2", "RolloutConfig.max_new_tokens = 4",
    "TrainConfig.checkpoint_every = 2", "ScheduleConfig.max_policy_lag = 1", "ScheduleConfig.version_schedule = 'fixed'",
    "ScheduleConfig.step_timeout_s = 120.0")]
KILLED = -9


def _child(run_dir, cache, *extra, kill_in_save=None, kill_in_step=None):
  env = dict(compat.xla_env(cpu_devices=4), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",  # make run's devices
             JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  flags = ([f"--kill_in_save={kill_in_save}"] if kill_in_save else []) + (
      [f"--kill_in_step={kill_in_step}"] if kill_in_step else [])
  return subprocess.run([sys.executable, str(ROOT / "tests" / "fault_child.py"), *flags, "--", *TRAIN_ARGS,
                         "--run_dir", str(run_dir), *extra], env=env, capture_output=True, text=True,
                        timeout=400)


def _rows(run_dir):
  return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The runs of the module docstring, each a fresh interpreter (the tests using them are `slow`)."""
  base = tmp_path_factory.mktemp("fault")
  cache = base / "jax_cache"
  full, broken = base / "full", base / "broken"
  out = {"full": _child(full, cache)}
  assert out["full"].returncode == 0, out["full"].stderr[-3000:]
  out["kill_in_save"] = _child(broken, cache, kill_in_save=4)
  out["after_save_kill"] = {"complete": latest_complete_step(broken / "checkpoints"),
                            "dirs": sorted(p.name for p in (broken / "checkpoints").iterdir()),
                            "rows": [r["step"] for r in _rows(broken)]}
  out["kill_in_step"] = _child(broken, cache, "--resume", kill_in_step=5)
  out["after_step_kill"] = {"complete": latest_complete_step(broken / "checkpoints"),
                            "rows": [r["step"] for r in _rows(broken)]}
  out["resumed"] = _child(broken, cache, "--resume")
  return full, broken, out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kill_during_a_save_leaves_the_previous_checkpoint(runs):
  _, broken, out = runs
  assert out["kill_in_save"].returncode == KILLED
  state = out["after_save_kill"]
  assert state["complete"] == 2 and "4" in state["dirs"]  # checkpoint 4's arrays, without its manifest
  damaged = list((broken / "checkpoints" / "damaged").iterdir())  # set aside by the resume, not deleted
  assert [p.name.split(".")[0] for p in damaged] == ["4"] and not (damaged[0] / MANIFEST).exists()
  assert (damaged[0] / "state").is_dir()
  stderr = out["kill_in_step"].stderr
  assert "checkpoint step 4" in stderr and str(broken / "checkpoints" / "4" / MANIFEST) in stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kill_during_a_step_resumes_from_the_last_complete_checkpoint(runs):
  _, _, out = runs
  assert out["kill_in_step"].returncode == KILLED
  assert out["after_step_kill"]["complete"] == 4
  # 0: the held-out evaluation before RL; 3, 4 of the first attempt were rewound
  assert out["after_step_kill"]["rows"] == [0, 1, 2, 3, 4]
  assert out["resumed"].returncode == 0, out["resumed"].stderr[-3000:]
  assert '"resumed_from_step": 4' in out["resumed"].stdout


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_resumed_fixed_schedule_run_equals_the_uninterrupted_run(runs):
  """Every step logged once, and every non-timing metric of every step identical (bitwise: the same
  programs on the same inputs; the schedule fixes versions, prompts and seeds whatever the timing)."""
  full, broken, _ = runs
  a, b = _rows(full), _rows(broken)
  # 0: the evaluation before RL (logged once: a resume keeps the baseline); 6 three times: the step, the
  # evaluation after RL, and the before/after summary row
  assert [r["step"] for r in b] == [r["step"] for r in a] == [0, 1, 2, 3, 4, 5, 6, 6, 6]
  for ra, rb in zip(a, b):
    assert schedule_metrics(ra) == schedule_metrics(rb), ra["step"]
  assert a[-1]["eval/accuracy_after"] == b[-1]["eval/accuracy_after"]
  dropped = [json.loads(line)["step"] for line in (broken / "metrics.dropped.jsonl").read_text().splitlines()]
  assert dropped == [3, 4]  # logged by the first attempt after its last complete checkpoint: kept aside


@pytest.mark.timeout(1500)
def _train_script():
  """scripts/train.py as a module, to call its main() in this process."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # needs the `runs` fixture's checkpoints
@pytest.mark.devices(4)
def test_changed_config_resume_names_every_difference_and_touches_nothing(runs):
  """In this process (the check needs no compiled step): another model width, lag and learning rate."""
  _, broken, _ = runs
  before = {p: p.stat().st_mtime_ns for p in broken.rglob("*") if p.is_file()}
  module = _train_script()
  gin.clear_config()
  try:
    with pytest.raises(IncompatibleCheckpoint) as info:
      module.main(TRAIN_ARGS + ["--run_dir", str(broken), "--resume", "--gin_param=ModelConfig.hidden_size = 64",
                                "--gin_param=ScheduleConfig.max_policy_lag = 2", "--gin_param=OptimizerConfig.lr = 1e-3",
                                "--gin_param=OptimizerConfig.total_steps = 500"])
  finally:
    gin.clear_config()
  msg = str(info.value)
  assert "model.hidden_size: checkpoint 32, now 64" in msg and "max_policy_lag: checkpoint 1, now 2" in msg
  assert "optimizer.lr: checkpoint 0.0003, now 0.001" in msg
  assert "total_steps" not in msg  # a new lr schedule end may change on resume
  assert {p: p.stat().st_mtime_ns for p in broken.rglob("*") if p.is_file()} == before


# ---- in this process: the KL reference, the stall report ----

def _controller(tmp_path, reward, **kw):
  from flax import nnx

  from llamarl_jax.controller import Controller
  from llamarl_jax.data import PromptSource
  from llamarl_jax.config import OptimizerConfig, run_config
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama, split_params
  from llamarl_jax.tokenizer import make_char_tokenizer

  tok = make_char_tokenizer()
  config = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
  _, params = split_params(Llama(config, rngs=nnx.Rngs(params=0)))
  run = run_config(reward_fn=reward.name, prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6, trainer_fsdp=2,
                   generator_dp=2, optimizer=OptimizerConfig(lr=1e-2), **kw)
  return Controller(config, params, tok, PromptSource(task="arithmetic", seed=0), run_dir=tmp_path, config=run,
                    reward=reward, progress=False)


_BLOCK = {"until": 0.0}


def _varied_reward(response_text, ground_truth):
  """Rewards that differ between samples (so advantages and the update are non-zero); blocks until
  the monotonic time _BLOCK["until"] (kept short: the run's shutdown joins the reward thread)."""
  import time

  while time.monotonic() < _BLOCK["until"]:
    time.sleep(0.05)
  return (sum(map(ord, response_text)) % 7) / 6.0  # varies with the sampled characters


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
  """A lag-0 run with only `loss_kwargs={'kl_coef': 0.5}` set (as a gin binding gives it): 2 steps, then
  checkpointed."""
  from llamarl_jax.executors.reward import RewardExecutor

  c = _controller(tmp_path_factory.mktemp("kl"), RewardExecutor(_varied_reward, inline=True), max_policy_lag=0,
                  loss_kwargs={"rho_max": 2.0, "kl_coef": 0.5}, checkpoint_every=2)
  try:
    yield c, c.run(2)
  finally:
    _BLOCK["until"] = 0.0
    c.close()


@pytest.mark.devices(4)
@pytest.mark.slow
def test_kl_coef_from_the_config_uses_the_initial_policy_as_reference(kl_run):
  """The reference is the initial policy: KL(pi || ref) is 0 at the first step and > 0 once the policy
  moved; it is checkpointed and restored (a resume must not re-anchor it to the resumed policy)."""
  import jax
  import numpy as np

  c, steps = kl_run
  # step 1: pi == ref (same fp32 params; two forwards in one program may round differently by ~1 ulp)
  assert abs(steps[0]["policy/kl_ref"]) < 1e-6 and steps[1]["policy/kl_ref"] > 1e-6
  assert steps[1]["loss/kl"] == pytest.approx(0.5 * steps[1]["policy/kl_ref"], rel=1e-5)
  saved = [np.asarray(x) for x in jax.tree.leaves(c.trainer.ref_params)]
  c.trainer.load_params(jax.tree.map(lambda a: a + 1.0, c.trainer.params))  # a warm start re-anchors it...
  assert not np.array_equal(np.asarray(jax.tree.leaves(c.trainer.ref_params)[0]), saved[0])
  assert c.restore_checkpoint() == 2  # ...a restore brings the checkpointed reference back
  for a, b in zip(jax.tree.leaves(c.trainer.ref_params), saved):
    np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.devices(4)
def test_a_stalled_executor_is_named_when_the_step_times_out(kl_run):
  c, _ = kl_run  # compiled already: the stall below is the reward function's alone
  import time

  c.config = c.config.replace(schedule=c.config.schedule.replace(step_timeout_s=1.5))
  _BLOCK["until"] = time.monotonic() + 3.0
  with pytest.raises(TimeoutError, match=r"step 2: no scored batch within step_timeout_s = 1.5 s\. Stalled: the "
                                         r"reward executor.*reward executor: scoring batch 2 for \d+ s"):
    c.run(1)


def test_a_reference_of_another_architecture_is_refused(tmp_path):
  """Controller(reference_path=...) loads the KL reference with this check before building the trainer."""
  from flax import nnx

  from llamarl_jax.model import hf
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama

  other = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                      max_position_embeddings=64, tie_word_embeddings=True)
  hf.save_hf_checkpoint(Llama(other, rngs=nnx.Rngs(params=0)), other, tmp_path / "ref")
  with pytest.raises(ValueError, match=r"KL reference .*ref does not have the policy's architecture \(vocab_size: "
                                       r"policy 67, reference 16; hidden_size: policy 32, reference 16"):
    hf.load_reference_params(str(tmp_path / "ref"), other.replace(vocab_size=67, hidden_size=32, intermediate_size=32))
  import jax

  from llamarl_jax.model.llama import split_params

  model = Llama(other, rngs=nnx.Rngs(params=0))
  same = hf.load_reference_params(str(tmp_path / "ref"), other)  # the same architecture loads: the saved weights
  for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(split_params(model)[1])):
    assert a.shape == b.shape and float(abs(a - b).max()) == 0.0


@pytest.mark.devices(4)
@pytest.mark.slow
def test_ctrl_c_during_the_warm_start_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
  from llamarl_jax import experiment

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(experiment, "supervised_warmstart", interrupted)
  module = _train_script()
  gin.clear_config()
  try:
    with pytest.raises(SystemExit) as info:
      module.main(TRAIN_ARGS + ["--run_dir", str(tmp_path / "run"), "--gin_param=run_experiment.sft = True"])
  finally:
    gin.clear_config()
  err = capsys.readouterr().err
  assert info.value.code == 130
  assert "nothing was saved" in err and "checkpointed" not in err and "newest complete checkpoint" not in err
  assert latest_complete_step(tmp_path / "run" / "checkpoints") is None
