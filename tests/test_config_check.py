"""Start-up validation of gin bindings: every shipped config passes; wrong types, out-of-range values and
missing inputs (data files, model directories, tokenizers) fail before anything is built, each named by its
binding, and scripts/train.py ends on them with one message."""

import os
import subprocess
import sys
from pathlib import Path

import gin
import pytest

from llamarl_jax import experiment  # noqa: F401  (registers the configurables)
from llamarl_jax.config_check import ConfigError, binding_problems, check_bindings, check_inputs, input_problems

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def parse(monkeypatch):
  monkeypatch.chdir(ROOT)

  def parse(name, *bindings):
    gin.clear_config()
    gin.parse_config_files_and_bindings([str(ROOT / "configs" / name)], list(bindings))

  yield parse
  gin.clear_config()


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.gin") if p.name != "base.gin"))
def test_shipped_configs_are_valid(parse, name):
  parse(name)
  assert binding_problems() == []


def test_every_bad_binding_is_named(parse):
  parse("tiny_cpu.gin", "TrainConfig.checkpoint_every = '5'", "RolloutConfig.top_p = 2", "run_experiment.sft = 1",
        "OptimizerConfig.lr = -1.0", "TrainConfig.loss_kwargs = {'rho_maxx': 2.0}", "LAG = -1",
        "ScheduleConfig.max_policy_lag = %LAG", "eval/RolloutConfig.seed = 'x'", "TrainConfig.optimizer = @ModelConfig()",
        "ModelConfig.num_layers = 0", "PromptSource.bad_rows = 'ignore'", "run_experiment.eval_window = 0",
        "run_experiment.eval_every = 2.5")
  with pytest.raises(ConfigError) as info:
    check_bindings()
  msg = str(info.value)
  for expected in ("TrainConfig.checkpoint_every = '5': expected int, found str",
                   "RolloutConfig.top_p = 2: expected in (0.0, 1.0]",
                   "run_experiment.sft = 1: expected bool, found int",
                   "OptimizerConfig.lr = -1.0: expected >= 0.0",
                   "unknown: ['rho_maxx']",
                   "ScheduleConfig.max_policy_lag = -1: expected >= 0",  # through a macro
                   "eval/RolloutConfig.seed = 'x': expected int",        # a scoped binding
                   "TrainConfig.optimizer = @ModelConfig(): expected OptimizerConfig",
                   "ModelConfig.num_layers = 0: expected >= 1",
                   "PromptSource.bad_rows = 'ignore': expected one of ['skip', 'error']",
                   "run_experiment.eval_window = 0: expected >= 1",
                   "run_experiment.eval_every = 2.5: expected int, found float"):
    assert expected in msg, (expected, msg)
  assert msg.startswith("12 gin binding(s) are invalid")


def test_ints_are_floats_but_bools_are_not_ints(parse):
  parse("tiny_cpu.gin", "OptimizerConfig.lr = 1", "RolloutConfig.top_k = True")
  assert binding_problems() == ["RolloutConfig.top_k = True: expected int, found bool"]


def test_train_py_stops_before_building_anything(tmp_path):
  """The check runs first in run_experiment: no run directory, no compilation."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  gin.clear_config()
  argv = ["--gin_file", str(ROOT / "configs" / "tiny_cpu.gin"), "--run_dir", str(tmp_path / "run"),
          "--gin_param=TrainConfig.checkpoint_every = '5'"]
  try:
    with pytest.raises(SystemExit,
                       match=r"^error: 1 gin binding\(s\) are invalid.*\n  TrainConfig.checkpoint_every = '5'"):
      module.main(argv)
    gin.clear_config()
    with gin.unlock_config(), pytest.raises(ConfigError, match="TrainConfig.checkpoint_every = '5'"):
      module.main(argv + ["--debug"])  # --debug: the exception itself, with its traceback
  finally:
    gin.clear_config()
  assert not (tmp_path / "run").exists()


def _train_py(*args, cwd=ROOT):
  """scripts/train.py in a fresh interpreter (JAX on the CPU, every compilation logged)."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
  return subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=120)


def test_the_shipped_gsm8k_config_without_its_data_is_one_message(tmp_path):
  """Run as shipped (placeholder paths): one message naming each binding to set, a non-zero exit, no
  traceback, and nothing built or compiled."""
  run_dir = tmp_path / "run"
  proc = _train_py("--gin_file=configs/llama3_1b_1gpu_gsm8k.gin", f"--run_dir={run_dir}")
  assert proc.returncode != 0 and proc.stdout == ""
  assert "Traceback" not in proc.stderr and "Compiling" not in proc.stderr, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert lines[0] == "error: 3 input(s) the config names cannot be read (nothing was built or run):", proc.stderr
  assert lines[1] == ("  build_policy.model_path = '/path/to/Llama-3.2-1B-Instruct': /path/to/Llama-3.2-1B-Instruct "
                      "is not a directory (expected a Hugging Face model directory)")
  assert lines[2] == ("  train/PromptSource.files = '/path/to/gsm8k/train.jsonl': prompt file "
                      "/path/to/gsm8k/train.jsonl does not exist")
  assert lines[3].startswith("  eval/PromptSource.files = '/path/to/gsm8k/test.jsonl'")
  assert len(lines) == 6 and lines[-1] == "(--debug shows the traceback)"
  assert not run_dir.exists()  # --debug (the traceback): test_train_py_stops_before_building_anything


def test_the_memory_plan_of_the_gsm8k_config_without_its_model_is_one_message():
  """scripts/memory_plan reads the model's config (no data): only the model directory is named."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "scripts.memory_plan", "--gin_file=configs/llama3_1b_1gpu_gsm8k.gin"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.startswith("error: 1 input(s) the config names cannot be read")
  assert "build_policy.model_path = '/path/to/Llama-3.2-1B-Instruct'" in proc.stderr
  assert "PromptSource" not in proc.stderr


def test_a_config_gin_cannot_parse_is_one_message(tmp_path, monkeypatch):
  """An include not found from the working directory and an unknown configurable: one message each."""
  import importlib.util

  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  try:
    for cwd, argv, expected in ((tmp_path, [f"--gin_file={ROOT / 'configs' / 'tiny_cpu.gin'}"], "configs/base.gin"),
                                (ROOT, ["--gin_file=configs/tiny_cpu.gin", "--gin_param=TrainConfg.lr = 2"],
                                 "TrainConfg")):
      monkeypatch.chdir(cwd)
      gin.clear_config()
      with pytest.raises(SystemExit) as info:
        module.main(argv)
      assert str(info.value).startswith("error: the gin config cannot be parsed: ") and expected in str(info.value)
      assert f"relative to the working directory, here {cwd}" in str(info.value)
  finally:
    gin.clear_config()


def test_every_missing_input_is_named_by_its_binding(parse, tmp_path):
  """Prompt files and globs, model directories without config.json or a tokenizer, a reference without
  config.json, an adapter directory without adapter_config.json: each named; present ones pass."""
  model = tmp_path / "model"
  model.mkdir()
  (model / "config.json").write_text("{}")
  data = tmp_path / "train.jsonl"
  data.write_text("")
  parse("tiny_cpu.gin", f"build_policy.model_path = '{model}'",
        f"train/PromptSource.files = ['{data}', '{tmp_path}/*.parquet']",
        f"TrainConfig.reference_path = '{tmp_path}'", f"eval/PromptSource.files = '{data}'")
  assert sorted(input_problems()) == [
      f"TrainConfig.reference_path = '{tmp_path}': {tmp_path} has no config.json (expected the KL reference's Hugging "
      "Face model directory)",
      f"build_policy.model_path = '{model}': {model} has no tokenizer "
      "(tokenizer.json / tokenizer_config.json / tokenizer.model)",
      f"train/PromptSource.files = ['{data}', '{tmp_path}/*.parquet']: no files match {tmp_path}/*.parquet"]
  (model / "tokenizer.json").write_text("{}")
  parse("tiny_cpu.gin", f"build_policy.model_path = '{model}'", f"train/PromptSource.files = '{data}'")
  assert input_problems() == []
  check_inputs()


def test_each_config_class_validates_its_fields_once_when_built_from_python():
  """The same rules as the gin check (config.py RULES), also for configs built in Python."""
  from llamarl_jax import config as cfg

  with pytest.raises(cfg.ConfigError) as info:
    cfg.RolloutConfig(top_p=2.0, samples_per_prompt=1)
  assert "RolloutConfig.top_p: expected in (0.0, 1.0], got 2.0" in str(info.value)
  assert "RolloutConfig.samples_per_prompt: expected >= 2" in str(info.value)  # every bad field, at once
  with pytest.raises(cfg.ConfigError, match="GeneratorConfig.engine: expected one of \\['slots', 'static'\\]"):
    cfg.GeneratorConfig(engine="paged")
  with pytest.raises(cfg.ConfigError, match="unknown: \\['rho'\\]"):
    cfg.TrainConfig(loss="aipo", loss_kwargs={"rho": 2.0})
  with pytest.raises(cfg.ConfigError, match="unknown run setting"):
    cfg.run_config(max_lag=2)
  built = cfg.run_config(max_policy_lag=3, generator_engine="static", reward_fn="math")
  assert (built.schedule.max_policy_lag, built.generator.engine, built.reward.fn) == (3, "static", "math")
  # every flat key maps to a field that exists
  for key in cfg.FLAT_KEYS:
    section, name = cfg.FLAT_KEYS[key]
    assert name in {f.name for f in __import__("dataclasses").fields(cfg.SECTIONS[section])}, key


def test_every_typed_setting_has_one_flat_key():
  """`run_config(**flat)` reaches every field of every section of RunConfig, each through exactly one
  flat key: a field added to a config class without its flat key fails here."""
  import dataclasses

  from llamarl_jax import config as cfg

  assert [f.name for f in dataclasses.fields(cfg.RunConfig)] == list(cfg.SECTIONS)
  fields = [(section, f.name) for section, cls in cfg.SECTIONS.items() for f in dataclasses.fields(cls)]
  mapped = list(cfg.FLAT_KEYS.values())
  assert sorted(mapped) == sorted(fields), (sorted(set(fields) - set(mapped)), sorted(set(mapped) - set(fields)))
  built = cfg.run_config(engine_staged_slots=4, scan_layers=False, env_name="tools", max_turns=3, tools=["calc"])
  assert (built.generator.staged_slots, built.train.scan_layers, built.env.name, built.env.max_turns,
          built.env.tools) == (4, False, "tools", 3, ("calc",))


def test_new_objectives_and_overlong_shaping_from_gin(parse):
  """GSPO / CISPO / the rollout corrections are chosen by name with their own keyword arguments;
  DAPO's overlong shaping and dynamic sampling are configurables whose bad values are named."""
  for loss, kwargs in [("gspo", "{'eps_low': 3e-4, 'eps_high': 4e-4}"), ("cispo", "{'eps_high': 1.0}"),
                       ("seq_tis", "{'is_threshold': 2.0}"), ("mis", "{'level': 'geometric', 'rs_threshold': 1.01}")]:
    parse("tiny_cpu.gin", f"TrainConfig.loss = '{loss}'", f"TrainConfig.loss_kwargs = {kwargs}",
          "RolloutConfig.overlong = @OverlongShaping()", "OverlongShaping.buffer_len = 4",
          "OverlongShaping.mask_truncated = True")
    assert binding_problems() == [], loss
  parse("tiny_cpu.gin", "TrainConfig.loss = 'gspo'", "TrainConfig.loss_kwargs = {'rho_max': 2.0}",
        "RolloutConfig.overlong = @OverlongShaping()", "OverlongShaping.buffer_len = -1",
        "RolloutConfig.dynamic_sampling = @DynamicSampling()", "DynamicSampling.max_draws = 0")
  problems = "\n".join(binding_problems())
  assert "unknown: ['rho_max']" in problems and "OverlongShaping.buffer_len = -1: expected an int >= 0" in problems
  assert "DynamicSampling.max_draws = 0: expected an int >= 1" in problems
  parse("tiny_cpu.gin", "GeneratorConfig.engine = 'static'", "RolloutConfig.dynamic_sampling = @DynamicSampling()",
        "DynamicSampling.max_draws = 3")
  assert binding_problems() == []
