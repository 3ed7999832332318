"""Many processes: trainer, generator (and reward model) as separate process groups of one jax.distributed job.

Every multi-process run is real: fresh interpreters started by scripts/launch_local.py (free ports,
CPU devices per process, a hard `timeout_s` after which the launcher kills the whole job), the
cross-process weight push and batch transfer over JAX's CPU transfer sockets.

The equality tests compare per-step metrics (all but timings: `schedule_metrics`) of 1, 2 and 4
processes running the same tiny config from the same warm start (rewards not all 0), bit for bit: the 'fixed' version schedule makes each step a
pure function of (config, seed); the meshes have the same shapes in every layout (trainer fsdp2 x tp2,
generator dp2 x tp2), so XLA runs the same programs; every cross-device reduction has 2 participants
(a + b is exact whichever process adds), and fp32 throughout. The reward-model run (trainer,
generator and reward model as three processes of one device each) is compared with the one-process
run on the same three single-device meshes, without a warm start: the reward model's scores make the
rewards, and so the advantages, differ from 0.
"""

import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gin
import jax
import pytest

from llamarl_jax.controller import schedule_metrics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # every test starts 2-4 fresh JAX interpreters (`make test` skips them)
TINY = [
    "ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
    "run_experiment.sft = False", "run_experiment.eval_size = 0", "run_experiment.export = False",
    "run_experiment.tensorboard = False", "run_experiment.progress = False",
    "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 2", "RolloutConfig.max_new_tokens = 6",
    "RewardConfig.workers = 1", "TrainConfig.checkpoint_every = 0",
    "MeshConfig.trainer_tp = 2", "MeshConfig.generator_tp = 2",  # 8 devices: trainer fsdp2 x tp2, generator dp2 x tp2
]


# A warm start (a short supervised run on the task, on the trainer mesh) so that rewards, advantages,
# losses and ratios are not all 0: the equality tests then compare a run that learns, every metric
# but timings. 200 steps of the 2-layer model give a reward of 0.125 at step 3 (measured). It runs
# once per module (`warm_start`, exported in HF format) and the runs start RL from that export; only
# the four-process job repeats it, across its trainer processes (its 200 steps are 200 cross-process
# all-reduces there).
WARM = ["--gin_param=run_experiment.sft = True", "--gin_param=supervised_warmstart.steps = 200"]
# demonstrations in the verifier's format (the dynamic-sampling test: rewards from step 1)
PLAIN_FORMAT = ["--gin_param=PromptSource.task_kwargs = {'min_digits': 1, 'max_digits': 2, 'num_operands': 2, 'ops': '+'}"]


def _script(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


launch_local = _script("launch_local")


def _args(run_dir, steps, *extra):
  return (["--gin_file=configs/tiny_cpu.gin", f"--run_dir={run_dir}"]
          + [f"--gin_param={b}" for b in TINY + [f"run_experiment.rl_steps = {steps}"]] + list(extra))


def _launch(n, args, *, timeout_s, script=None, on_start=None, fail_fast=True):
  """Run a job of n processes; returns (exit status, its prefixed output). fail_fast=False: after a
  failure the launcher lets the others end on their own (they must, within the heartbeat timeout)."""
  out = io.StringIO()
  kw = {"script": script} if script else {}
  status = launch_local.launch(n, args, timeout_s=timeout_s, heartbeat_timeout_s=5, out=out, on_start=on_start,
                               fail_fast=fail_fast, **kw)
  return status, out.getvalue()


def _steps(run_dir):
  rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
  return [r for r in rows if "reward/mean" in r]


# (the transfer order and the reward shares are pure functions of the schedule: tests/test_schedule.py)


# ------------------------------------------------------------------------------------------------
# transfers and faults, without a model


def test_weight_push_and_batch_transfer_between_meshes_of_different_sizes():
  status, out = _launch(3, ["--case", "transfer"], timeout_s=120, script=ROOT / "tests" / "multiproc_worker.py")
  assert status == 0, out
  for line in ("A weights v1 ok", "B weights v1 ok", "C weights v1 ok", "A rows ok (1 chunks)",
               "B rows ok (2 chunks)", "C rows ok (1 chunks)"):
    assert line in out, (line, out)


def test_lora_push_moves_the_base_once_then_only_adapters_and_the_generator_merges():
  status, out = _launch(3, ["--case", "lora"], timeout_s=120, script=ROOT / "tests" / "multiproc_worker.py")
  assert status == 0, out
  for version in range(3):
    assert f"lora v{version} ok" in out, (version, out)


def test_moe_expert_lora_push_merges_into_the_generator_as_the_trainers_adapted_forward():
  """LoRA on a Qwen3-MoE's experts across processes: the trainer process pushes the per-expert
  adapters (the base when it changed), the generator processes merge them, and each one's merged
  model gives the logits of the trainer's unmerged forward (multiproc_worker's lora_experts case)."""
  status, out = _launch(3, ["--case", "lora_experts"], timeout_s=180, script=ROOT / "tests" / "multiproc_worker.py")
  assert status == 0, out
  for version in range(3):
    for rank in (1, 2):
      assert f"[rank {rank}] lora v{version} ok" in out, (rank, version, out)


def test_a_reward_model_on_a_mesh_over_two_processes_scores_like_one_device(tmp_path):
  from test_reward_model import tiny_hf_classifier

  tiny_hf_classifier("llama", seed=3).save_pretrained(tmp_path / "rm")
  status, out = _launch(2, ["--case", "reward_mesh", "--path", str(tmp_path / "rm")], timeout_s=120,
                        script=ROOT / "tests" / "multiproc_worker.py")
  assert status == 0, out
  assert "[rank 0] reward mesh ok" in out and "[rank 1] reward mesh ok" in out, out


@pytest.mark.parametrize("kill,consequence", [(False, False), (True, False), (True, True)])
def test_a_failed_process_stops_every_other_naming_it(kill, consequence):
  """Process 1 raises (its error is published) or is SIGKILLed (its heartbeats stop: 5 s here):
  the others exit EXIT_PEER_FAILED (75) within seconds, naming rank 1 and its role; no hang.
  consequence: process 0 also raises, 0.5 s after the kill (a closed socket), before the heartbeat
  timeout: it still names process 1 as the cause, and so does the launcher."""
  t0 = time.monotonic()
  flags = (["--kill"] if kill else []) + (["--consequence"] if consequence else [])
  status, out = _launch(3, ["--case", "fault"] + flags, timeout_s=90,
                        script=ROOT / "tests" / "multiproc_worker.py", fail_fast=False)
  elapsed = time.monotonic() - t0
  assert status != 0 and elapsed < 60, (status, elapsed, out)  # the 120 s sleep never finished
  assert "still running" not in out
  why = "died (no heartbeat" if kill else "failed: ValueError: injected failure"
  for rank in (0, 2):
    assert f"[rank {rank}] [llamarl] process {rank} " in out and f"stops: process 1 (generator) {why}" in out, out
  assert "[launch_local] rank 1 (generator) failed with " + ("signal SIGKILL" if kill else "exit status 1") in out


# ------------------------------------------------------------------------------------------------
# whole runs


def _train(run_dir, steps, *extra):
  """scripts/train.py in this (8-device) process."""
  gin.clear_config()
  try:
    _script("train").main(_args(run_dir, steps, *extra))
  finally:
    gin.clear_config()


def _warm_export(tmp_path_factory, *extra):
  """The warm start alone (no RL step), exported in HF format; returns the arguments that start a run
  from it (`build_policy.model_path`, no warm start of its own)."""
  run_dir = tmp_path_factory.mktemp("warm") / "run"
  _train(run_dir, 0, *WARM, "--gin_param=run_experiment.export = True", *extra)
  export = run_dir / "hf_export"
  assert (export / "config.json").exists(), sorted(p.name for p in run_dir.iterdir())
  return [f"--gin_param=build_policy.model_path = '{export}'", *extra]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
  return _warm_export(tmp_path_factory)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, warm_start):
  """The reference: scripts/train.py in this (8-device) process, 5 steps from the warm start."""
  run_dir = tmp_path_factory.mktemp("one") / "run"
  _train(run_dir, 5, *warm_start)
  steps = _steps(run_dir)
  assert any(m["reward/mean"] > 0 for m in steps[:3]), [m["reward/mean"] for m in steps]  # compared: not all 0
  return steps


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # the warm start and 2-4 interpreters on 2 cores; the launcher's own hard limit is 420 s
def test_two_processes_give_the_one_process_metrics(one_process_run, warm_start, tmp_path):
  """1 trainer process (fsdp2 x tp2) + 1 generator process (dp2 x tp2), launched as a user types it.
  With held-out evaluations (greedy + sampled) before RL, at step 2 and after step 3: across processes
  the run is split at step 2 for it, which must not change what is trained (the one-process reference
  does not evaluate)."""
  evals = [f"--gin_param={b}" for b in ("run_experiment.eval_size = 4", "run_experiment.eval_every = 2",
                                        "run_experiment.eval_samples = 2")]
  cmd = [sys.executable, str(ROOT / "scripts" / "launch_local.py"), "--num_processes", "2", "--timeout_s", "420",
         "--heartbeat_timeout_s", "5", "--", *_args(tmp_path / "run", 3, *warm_start), *evals]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=480)
  assert done.returncode == 0, done.stdout + done.stderr
  assert "[rank 0] [llamarl] process 0/2 role=trainer" in done.stdout and "process 1/2 role=generator" in done.stdout
  steps = _steps(tmp_path / "run")
  assert [m["step"] for m in steps] == [1, 2, 3] and [m["policy/lag_max"] for m in steps] == [0, 1, 1]
  for one, two in zip(one_process_run, steps):
    assert schedule_metrics(one) == schedule_metrics(two)
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  evaluated = [r for r in rows if "eval/accuracy" in r]
  assert [r["step"] for r in evaluated] == [0, 2, 3]
  for r in evaluated:  # 4 problems: greedy accuracy a multiple of 1/4, sampled pass@1 of 1/8
    assert r["eval/accuracy"] * 4 == round(r["eval/accuracy"] * 4)
    assert r["eval/pass1_sampled"] * 8 == round(r["eval/pass1_sampled"] * 8)


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # the warm start and 2-4 interpreters on 2 cores; the launcher's own hard limit is 420 s
def test_four_processes_give_the_one_process_metrics(one_process_run, tmp_path):
  """Trainer FSDP over processes 0-1 (tp inside each), generator data-parallel over processes 2-3.
  This job does the warm start itself, across its two trainer processes (the other runs start from
  its export): the reference started from the one-process warm start's HF export, so the equality
  also shows the cross-process warm start equal to the one-process one and the export exact."""
  status, out = _launch(4, _args(tmp_path / "run", 3, *WARM), timeout_s=420)
  assert status == 0, out
  assert "roles: 0=trainer, 1=trainer, 2=generator, 3=generator" in out
  steps = _steps(tmp_path / "run")
  assert len(steps) == 3
  for one, four in zip(one_process_run, steps):
    assert schedule_metrics(one) == schedule_metrics(four)


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # the warm start and 2-4 interpreters on 2 cores; the launcher's own hard limit is 420 s
def test_killed_generator_stops_the_run_and_resume_continues_exactly(one_process_run, warm_start, tmp_path,
                                                                     monkeypatch):
  """Kill the generator process after the step-2 checkpoint: the trainer exits non-zero within
  seconds naming it; the last checkpoint is intact, and --resume finishes the run from it with the
  uninterrupted run's metrics (data position, version schedule and the generator weights of the
  versions before the checkpoint all restored)."""
  run_dir = tmp_path / "run"
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_cache"))  # shared by the two jobs
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  args = _args(run_dir, 5, *warm_start, "--gin_param=TrainConfig.checkpoint_every = 1",
               "--gin_param=GeneratorConfig.delay_s = 0.5")  # steps slow enough to kill mid-run
  killed = {}

  def kill_after_checkpoint(procs):
    def watch():
      deadline = time.monotonic() + 380
      while time.monotonic() < deadline and not (run_dir / "checkpoints" / "2" / "MANIFEST.json").exists():
        time.sleep(0.1)
      killed["at"] = time.monotonic()
      os.kill(procs[1].pid, signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()

  status, out = _launch(2, args, timeout_s=420, on_start=kill_after_checkpoint, fail_fast=False)
  assert status != 0 and "at" in killed, out
  assert time.monotonic() - killed["at"] < 45, out  # 5 s heartbeat + the launcher's stop
  assert "[launch_local] rank 1 (generator) failed with signal SIGKILL" in out
  assert "process 0 (trainer) stops: process 1 (generator) died" in out
  done = [m["step"] for m in _steps(run_dir)]
  assert done[:2] == [1, 2] and done[-1] < 5, done  # killed mid-run

  status, out = _launch(2, args + ["--resume"], timeout_s=420)
  assert status == 0, out
  steps = _steps(run_dir)  # the log was rewound to the restored checkpoint, then continued
  assert [m["step"] for m in steps] == [1, 2, 3, 4, 5]
  for one, resumed in zip(one_process_run, steps):
    assert schedule_metrics(one) == schedule_metrics(resumed)
  shutil.rmtree(run_dir)


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # the warm start and 2 interpreters on 2 cores; the launcher's own hard limit is 300 s
def test_lora_two_processes_give_the_one_process_metrics_moving_only_adapters(warm_start, tmp_path):
  """A LoRA policy (rank 8, every projection) over the warm start's base, 3 steps: the trainer process
  sends the frozen base with the first push only and the adapters with every push, the generator
  process merges them; every per-step metric equals the one-process run's (which merges on its
  generator mesh), and each push moved exactly the adapters' bytes."""
  from llamarl_jax.config import LoraConfig
  from llamarl_jax.model import lora as lora_lib
  from llamarl_jax.model.config import ModelConfig

  lora = ["--gin_param=TrainConfig.lora = @LoraConfig()", "--gin_param=LoraConfig.rank = 8",
          "--gin_param=LoraConfig.alpha = 16.0", "--gin_param=OptimizerConfig.lr = 3e-3", *warm_start]
  _train(tmp_path / "one", 3, *lora)
  status, out = _launch(2, _args(tmp_path / "two", 3, *lora), timeout_s=300)
  assert status == 0, out
  one, two = _steps(tmp_path / "one"), _steps(tmp_path / "two")
  assert len(one) == len(two) == 3
  tiny = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
  adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(lora_lib.adapter_shapes(tiny, LoraConfig(rank=8, alpha=16.0))))
  assert adapter_bytes == 2 * 8 * 512 * 4  # per layer: rank x (in + out) summed over q k v o gate up down
  assert all(m["sync/bytes"] == adapter_bytes for m in two), [m["sync/bytes"] for m in two]
  assert any(m["reward/mean"] > 0 for m in one) and any(m["train/grad_norm"] > 0 for m in one)
  for a, b in zip(one, two):
    assert schedule_metrics(a) == schedule_metrics(b)


def _one_and_two_processes(tmp_path, params: list[str]) -> tuple[list[dict], list[dict]]:
  """3 steps of the same run in one process and across two: each run's per-step metrics."""
  _train(tmp_path / "one", 3, *params)
  status, out = _launch(2, _args(tmp_path / "two", 3, *params), timeout_s=300)
  assert status == 0, out
  one, two = _steps(tmp_path / "one"), _steps(tmp_path / "two")
  assert len(one) == len(two) == 3
  return one, two


def _assert_fp8_runs_agree(one: list[dict], two: list[dict], fp32_bytes: int) -> None:
  """Each push moved the same bytes in both runs, under half of the fp32 model's; the lag-0 mismatch
  metrics see the fp8 gap; every per-step metric of the schedule is equal."""
  assert all(a["sync/bytes"] == b["sync/bytes"] < 0.5 * fp32_bytes for a, b in zip(one, two))
  assert max(m["rollout_corr/lag0/kl_k3"] for m in one if "rollout_corr/lag0/kl_k3" in m) > 1e-6
  for a, b in zip(one, two):
    assert schedule_metrics(a) == schedule_metrics(b)


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # the warm start and 2 interpreters on 2 cores; the launcher's own hard limit is 300 s
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp8_two_processes_give_the_one_process_metrics(warm_start, tmp_path, lora):
  """An fp8 generator, 3 steps: the trainer process quantises before the wire, the fp8 values and
  scales cross, the generator process fuses them and samples with fp8 GEMMs, the fp8 lm_head's copy
  of the tied embedding included ('fp8+lm_head'); LoRA: the adapters cross, the generator
  process merges and quantises (the lm_head in the generator dtype). Every per-step metric equals the one-process
  run's (quantising is per-channel max and division: the same bits on any sharding), each push moved
  under half of the fp32 model's bytes, and the mismatch metrics see the fp8 gap at lag 0 (the fp32
  generator's is ~1e-9, test_controller)."""
  from llamarl_jax.model.config import ModelConfig

  adapters = ["--gin_param=TrainConfig.lora = @LoraConfig()", "--gin_param=LoraConfig.rank = 8",
              "--gin_param=LoraConfig.alpha = 16.0"] if lora else []
  quantize = "'fp8'" if lora else "'fp8+lm_head'"
  quantized = [f"--gin_param=GeneratorConfig.quantize = {quantize}", *adapters, *warm_start]
  one, two = _one_and_two_processes(tmp_path, quantized)
  fp32_bytes = 4 * ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2).num_params()
  _assert_fp8_runs_agree(one, two, fp32_bytes)


# a tiny Qwen3-MoE over TINY: both layers sparse, 4 experts of 32, top-2
MOE = ["ModelConfig.model_type = 'qwen3_moe'", "ModelConfig.num_experts = 4", "ModelConfig.num_experts_per_tok = 2",
       "ModelConfig.moe_intermediate_size = 32"]


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # 1 + 2 interpreters on 2 cores; the launcher's own hard limit is 300 s
def test_fp8_moe_two_processes_give_the_one_process_metrics(tmp_path):
  """A Qwen3-MoE policy with an fp8 generator, 3 steps from random init: the trainer process quantises
  the experts per (expert, output channel) before the wire, the fp8 values and scales cross, the
  generator process fuses gate/up and samples with the fp8 grouped matmul. Every per-step metric
  equals the one-process run's, each push moved under half of the fp32 model's bytes, and the
  mismatch metrics see the fp8 gap at lag 0."""
  from llamarl_jax.model.config import ModelConfig

  quantized = [f"--gin_param={b}" for b in [*MOE, "GeneratorConfig.quantize = 'fp8'"]]
  one, two = _one_and_two_processes(tmp_path, quantized)
  fp32_bytes = 4 * ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                               num_kv_heads=2, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32).num_params()
  _assert_fp8_runs_agree(one, two, fp32_bytes)


def test_dynamic_sampling_two_processes_give_the_one_process_metrics(tmp_path_factory, tmp_path):
  """DAPO's dynamic sampling (static engine), from a warm start (rewards not all 0, so groups are
  informative or not): the generator process redraws batch k's flat groups with batch k's version and
  derived seeds, scores them itself, keeps the informative ones first, and every per-step metric
  matches the one-process run's."""
  extra = ["--gin_param=GeneratorConfig.engine = 'static'",
           "--gin_param=RolloutConfig.dynamic_sampling = @DynamicSampling()", "--gin_param=DynamicSampling.max_draws = 2",
           *_warm_export(tmp_path_factory, *PLAIN_FORMAT)]
  _train(tmp_path / "one", 3, *extra)
  status, out = _launch(2, _args(tmp_path / "two", 3, *extra), timeout_s=300)
  assert status == 0, out
  one, two = _steps(tmp_path / "one"), _steps(tmp_path / "two")
  assert len(one) == len(two) == 3
  # the redraw path ran with real choices: some groups dropped, some kept, some reward earned
  assert any(0 < m["dynamic_sampling/drop_rate"] < 1 for m in one) and any(m["reward/mean"] > 0 for m in one)
  for a, b in zip(one, two):
    assert schedule_metrics(a) == schedule_metrics(b)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
  """A random tiny LlamaForSequenceClassification over the policy's (character) vocabulary, no tokenizer:
  it reads the policy's own token rows."""
  from test_reward_model import tiny_hf_classifier

  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  path = tmp_path_factory.mktemp("rm") / "rm"
  tiny_hf_classifier("llama", seed=7, pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer)).save_pretrained(path)
  return path


# trainer, generator and reward model on one device each: three processes of one device
REWARD_PROCESS = ["MeshConfig.trainer_fsdp = 1", "MeshConfig.trainer_tp = 1", "MeshConfig.generator_dp = 1",
                  "MeshConfig.generator_tp = 1", "MeshConfig.reward_dp = 1",
                  "RewardConfig.rule_weight = 0.5", "RewardConfig.model_weight = 2.0"]


@pytest.mark.devices(8)
@pytest.mark.timeout(600)  # 1 + 3 interpreters on 2 cores; the launcher's own hard limit is 300 s
def test_reward_model_in_its_own_process_gives_the_one_process_metrics(reward_model_dir, tmp_path):
  """Trainer, generator and reward model as three process groups (one process each), 3 steps at lag 1:
  the generator process publishes each batch's token rows, the reward process scores them on its
  device, the generator process combines 0.5 x rule + 2 x score. Every per-step metric (the rewards
  the advantages see, reward_model/score_mean and _std included) equals the one-process run's with
  the reward model on its own device (tests/test_reward_model_run.py checks that run's rewards
  against the reward model's own scores of the same rows)."""
  extra = [f"--gin_param={b}" for b in REWARD_PROCESS + [f"RewardConfig.model_path = '{reward_model_dir}'"]]
  _train(tmp_path / "one", 3, *extra)
  status, out = _launch(3, _args(tmp_path / "three", 3, *extra), timeout_s=300)
  assert status == 0, out
  assert "roles: 0=trainer, 1=generator, 2=reward" in out
  one, three = _steps(tmp_path / "one"), _steps(tmp_path / "three")
  assert len(one) == len(three) == 3
  for m in three:  # the mean of 0.5 x rule + 2 x score; scores that vary (a model, not a constant)
    assert m["reward/combined_mean"] == pytest.approx(0.5 * m["reward/mean"] + 2.0 * m["reward_model/score_mean"],
                                                      abs=1e-5)
    assert m["reward_model/score_std"] > 0.01
  for a, b in zip(one, three):
    assert schedule_metrics(a) == schedule_metrics(b)


@pytest.mark.timeout(300)  # 3 interpreters on 2 cores; the launcher's own hard limit is 180 s
def test_a_reward_process_that_fails_stops_every_process_naming_it(tmp_path):
  """The reward process raises on batch 0 (its model's context, 8 positions, is shorter than every
  row): it exits 1 with the reward model's error, the trainer and generator processes stop on their
  own within seconds naming it (no wait for scores that never come), and no step is logged."""
  from test_reward_model import tiny_hf_classifier

  from llamarl_jax.tokenizer import make_char_tokenizer

  tokenizer = make_char_tokenizer()
  tiny_hf_classifier("llama", pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer),
                     max_position_embeddings=8).save_pretrained(tmp_path / "rm")
  extra = [f"--gin_param={b}" for b in REWARD_PROCESS + [f"RewardConfig.model_path = '{tmp_path / 'rm'}'"]]
  t0 = time.monotonic()
  status, out = _launch(3, _args(tmp_path / "run", 3, *extra), timeout_s=180, fail_fast=False)
  assert status == 1 and time.monotonic() - t0 < 170, out
  assert "[launch_local] rank 2 (reward) failed with exit status 1" in out
  why = (f"failed: RewardModelError: reward model {tmp_path / 'rm'} failed scoring batch 0: ValueError: row 0 has")
  for rank, role in ((0, "trainer"), (1, "generator")):
    assert f"[rank {rank}] [llamarl] process {rank} ({role}) stops: process 2 (reward) {why}" in out, out
  assert not (tmp_path / "run" / "metrics.jsonl").exists() or not _steps(tmp_path / "run")


@pytest.mark.devices(8)
@pytest.mark.timeout(900)  # the warm start and 2 interpreters on 2 cores; the launcher's own hard limit is 300 s
def test_exact_logprobs_two_processes_give_zero_lag0_mismatch(warm_start, tmp_path):
  """`exact_logprobs` at lag 0 (trainer fsdp2, generator dp2: the switch refuses tensor shards), 3
  steps in one process and across two (the trainer's process computes pi, the generator's mu, the
  push between them): in both, every step's lag-0 k3 KL is exactly 0 and every ratio exactly 1, and
  every per-step metric is equal."""
  exact = [f"--gin_param={b}" for b in ("RolloutConfig.exact_logprobs = True", "ScheduleConfig.max_policy_lag = 0",
                                        "MeshConfig.trainer_tp = 1", "MeshConfig.generator_tp = 1")]
  one, two = _one_and_two_processes(tmp_path, [*exact, *warm_start])
  for m in one + two:
    assert m["rollout_corr/lag0/kl_k3"] == 0.0 and m["rollout_corr/lag0/num_tokens"] > 0, m["rollout_corr/lag0/kl_k3"]
    assert m["policy/ratio_max"] == 1.0 and m["policy/ratio_min"] == 1.0
  assert any(m["reward/mean"] > 0 for m in one)
  for a, b in zip(one, two):
    assert schedule_metrics(a) == schedule_metrics(b)
