"""The real-model gin configs parse with every binding known (a misspelt binding fails here, not on
the cluster) and their meshes (trainer, generator, reward model) use exactly the GPUs each file states."""

from pathlib import Path

import gin
import pytest

from llamarl_jax import experiment  # noqa: F401  (registers the configurables)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["llama3_8b.gin", "llama3_8b_rm.gin", "llama3_70b.gin", "llama3_405b.gin", "qwen2p5_1p5b.gin", "qwen3_1p7b.gin"]


@pytest.fixture
def parsed(monkeypatch):
  """Parse one config from the repo root (its `include 'configs/base.gin'` is relative to it)."""
  monkeypatch.chdir(ROOT)

  def parse(name):
    gin.clear_config()
    gin.parse_config_files_and_bindings([str(ROOT / "configs" / name)], [], skip_unknown=False)

  yield parse
  gin.clear_config()


@pytest.mark.parametrize("name", CONFIGS)
def test_config_parses_with_known_bindings_only(parsed, name):
  parsed(name)
  assert gin.query_parameter("build_policy.model_path").startswith(("/path/to/Meta-Llama-3.1-", "/path/to/Qwen"))
  assert gin.query_parameter("RewardConfig.fn") == "math"
  assert gin.query_parameter("GeneratorConfig.dtype") == "bfloat16"
  assert gin.query_parameter("TrainConfig.remat") is True


@pytest.mark.parametrize("name", CONFIGS)
def test_meshes_use_the_stated_gpu_count(parsed, name):
  parsed(name)
  q = gin.query_parameter
  trainer = q("MeshConfig.trainer_fsdp") * q("MeshConfig.trainer_tp")
  generator = q("MeshConfig.generator_dp") * q("MeshConfig.generator_tp")
  assert q("MeshConfig.colocated") is False  # disjoint meshes: their GPUs add up
  try:  # a reward model on devices of its own
    reward = q("MeshConfig.reward_dp") * q("MeshConfig.reward_tp")
  except ValueError:  # not bound: on the generator's devices
    reward = 0
  assert trainer + generator + reward == q("%NUM_GPUS")


@pytest.mark.parametrize("name", CONFIGS)
def test_batch_splits_over_trainer_ranks_and_microbatches(parsed, name):
  """The Controller's own check (rows % (microbatches * fsdp) == 0), before any device is touched."""
  parsed(name)
  q = gin.query_parameter
  rows = q("RolloutConfig.prompts_per_step") * q("RolloutConfig.samples_per_prompt")
  assert rows % (q("TrainConfig.microbatches") * q("MeshConfig.trainer_fsdp")) == 0


def test_misspelt_binding_fails(parsed, tmp_path, monkeypatch):
  bad = tmp_path / "bad.gin"
  bad.write_text((ROOT / "configs" / "llama3_8b.gin").read_text() + "\nMeshConfig.trainer_fdsp = 4\n")
  with pytest.raises(ValueError, match="trainer_fdsp"):
    gin.clear_config()
    gin.parse_config_files_and_bindings([str(bad)], [], skip_unknown=False)


def test_controller_keys_are_refused_naming_the_typed_key(parsed, tmp_path, monkeypatch):
  """Gin bindings of flat `Controller.*` keys fail at parse time naming each setting's typed key,
  in the file, in what it includes and in --gin_param bindings."""
  from llamarl_jax.config_check import ConfigError

  monkeypatch.chdir(tmp_path)
  (tmp_path / "old_base.gin").write_text("Controller.generator_engine = 'static'\n")
  old = tmp_path / "old.gin"
  old.write_text("include 'old_base.gin'\nController.max_policy_lag = 2\nController.trainer_fdsp = 4\n")
  with pytest.raises(ConfigError) as info:
    experiment.parse_gin([str(old)], ["Controller.reward_fn = 'math'", "GeneratorConfig.quantize_lm_head = True"])
  message = str(info.value)
  for line in ("Controller.max_policy_lag: use ScheduleConfig.max_policy_lag",
               "GeneratorConfig.quantize_lm_head: use GeneratorConfig.quantize = 'fp8+lm_head'",
               "Controller.generator_engine: use GeneratorConfig.engine",
               "Controller.reward_fn: use RewardConfig.fn",
               "Controller.trainer_fdsp: no setting of that name"):
    assert line in message


# the step-time model has no reward-model executor: llama3_8b_rm.gin keeps llama3_8b.gin's trainer and
# gives two of its generator's GPUs to the reward model (its memory plan is checked instead)
@pytest.mark.parametrize("name", [c for c in CONFIGS if c != "llama3_8b_rm.gin"])
def test_meshes_are_what_the_commented_perf_model_command_chooses(parsed, name, capsys):
  """Each file quotes the `python -m llamarl_jax.measure.perf_model ...` command its layout came from; rerun it."""
  import ast
  import shlex

  from llamarl_jax.measure import perf_model

  text = (ROOT / "configs" / name).read_text()
  command = next(line for line in text.splitlines() if "python -m llamarl_jax.measure.perf_model" in line)
  perf_model.main(shlex.split(command.split("llamarl_jax.measure.perf_model", 1)[1]))
  from llamarl_jax.config import new_key

  printed = next(line for line in capsys.readouterr().out.splitlines() if "run bindings:" in line)
  chosen = ast.literal_eval(printed.split("run bindings:", 1)[1].strip())
  parsed(name)
  assert {k: gin.query_parameter(new_key(k)) for k in chosen} == chosen
