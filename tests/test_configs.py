"""The real-model gin configs parse with every binding known (a misspelt binding fails here, not on
the cluster) and their meshes use exactly the GPUs each file states."""

from pathlib import Path

import gin
import pytest

from llamarl_jax import experiment  # noqa: F401  (registers the configurables)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["llama3_8b.gin", "llama3_70b.gin", "llama3_405b.gin", "qwen2p5_1p5b.gin", "qwen3_1p7b.gin"]


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
  assert gin.query_parameter("Controller.reward_fn") == "math"
  assert gin.query_parameter("Controller.generator_dtype") == "bfloat16"
  assert gin.query_parameter("Controller.remat") is True


@pytest.mark.parametrize("name", CONFIGS)
def test_meshes_use_the_stated_gpu_count(parsed, name):
  parsed(name)
  q = gin.query_parameter
  trainer = q("Controller.trainer_fsdp") * q("Controller.trainer_tp")
  generator = q("Controller.generator_dp") * q("Controller.generator_tp")
  assert q("Controller.colocated") is False  # disjoint meshes: their GPUs add up
  assert trainer + generator == q("%NUM_GPUS")


@pytest.mark.parametrize("name", CONFIGS)
def test_batch_splits_over_trainer_ranks_and_microbatches(parsed, name):
  """The Controller's own check (rows % (microbatches * fsdp) == 0), before any device is touched."""
  parsed(name)
  q = gin.query_parameter
  rows = q("Controller.prompts_per_step") * q("Controller.samples_per_prompt")
  assert rows % (q("Controller.microbatches") * q("Controller.trainer_fsdp")) == 0


def test_misspelt_binding_fails(parsed, tmp_path, monkeypatch):
  bad = tmp_path / "bad.gin"
  bad.write_text((ROOT / "configs" / "llama3_8b.gin").read_text() + "\nController.trainer_fdsp = 4\n")
  with pytest.raises(ValueError, match="trainer_fdsp"):
    gin.clear_config()
    gin.parse_config_files_and_bindings([str(bad)], [], skip_unknown=False)


@pytest.mark.parametrize("name", CONFIGS)
def test_meshes_are_what_the_commented_perf_model_command_chooses(parsed, name, capsys):
  """Each file quotes the `python -m llamarl_jax.perf_model ...` command its layout came from; rerun it."""
  import ast
  import shlex

  from llamarl_jax import perf_model

  text = (ROOT / "configs" / name).read_text()
  command = next(line for line in text.splitlines() if "python -m llamarl_jax.perf_model" in line)
  perf_model.main(shlex.split(command.split("llamarl_jax.perf_model", 1)[1]))
  printed = next(line for line in capsys.readouterr().out.splitlines() if "Controller bindings:" in line)
  chosen = ast.literal_eval(printed.split("Controller bindings:", 1)[1].strip())
  parsed(name)
  assert {k: gin.query_parameter(f"Controller.{k}") for k in chosen} == chosen
