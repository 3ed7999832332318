"""The main job end to end through `scripts/train.py`: SFT warm start, eval, async RL (generation,
rewards in worker processes, training, weight sync), checkpoints, JSONL/TensorBoard logs, HF export,
then `--resume` to continue, and the export loaded by `transformers` scoring the same as our model.

configs/tiny_cpu.gin with a smaller model and a handful of steps so it runs in well under 2 minutes.
"""

import importlib.util
import json
from pathlib import Path

import gin
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
# configs/tiny_cpu.gin: trainer fsdp=2 beside generator dp=2; whole runs (`slow`: `make test` skips them)
pytestmark = [pytest.mark.devices(4), pytest.mark.slow]
SMALL = [
    "ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
    "supervised_warmstart.steps = 10", "supervised_warmstart.batch_size = 16",
    "run_experiment.eval_size = 16", "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 4",
    "TrainConfig.checkpoint_every = 2", "run_experiment.tensorboard = True",
    "run_experiment.eval_every = 2", "run_experiment.eval_samples = 2",
]


def _train_main():
  spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main


def _run(run_dir, *extra_args, steps, small=SMALL, gin_file="tiny_cpu.gin"):
  gin.clear_config()
  try:
    params = [f"--gin_param={b}" for b in small + [f"run_experiment.rl_steps = {steps}"]]
    return _train_main()(["--gin_file", str(ROOT / "configs" / gin_file), "--run_dir", str(run_dir),
                          "--gin_param=run_experiment.progress = False", *params, *extra_args])
  finally:
    gin.clear_config()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """4 RL steps, then --resume to 6 (with another evaluation setting: a resumable change)."""
  run_dir = tmp_path_factory.mktemp("e2e") / "run"
  first = _run(run_dir, steps=4)
  second = _run(run_dir, "--resume", "--gin_param=run_experiment.eval_samples = 0", steps=6)
  return run_dir, first, second


def test_the_run_trains_checkpoints_logs_and_exports(finished_run):
  run_dir, first, _ = finished_run
  assert 0.0 <= first["eval_before_rl"] <= 1.0 and 0.0 <= first["eval_after_rl"] <= 1.0
  assert first["policy_lag_max"] <= 1
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl_steps = [r["step"] for r in rows if "reward/mean" in r]
  assert rl_steps == [1, 2, 3, 4, 5, 6]  # the resumed run continued at step 5, logging into the same file
  assert any("sft/nll" in r for r in rows)
  assert all(np.isfinite(r["loss/total"]) for r in rows if "loss/total" in r)
  assert list((run_dir / "tb").glob("events.out.tfevents.*")) or list(run_dir.rglob("events.out.tfevents.*"))


def test_mismatch_metrics_are_logged_every_step(finished_run):
  """rollout_corr/* (llamarl_jax.mismatch) in metrics.jsonl and TensorBoard at every RL step, split by lag."""
  from test_checkpoint import _tb_events

  run_dir = finished_run[0]
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if "reward/mean" in r]
  names = ("kl_k3", "ratio_mean", "ratio_max", "token_mult_prob_error")
  for r in rl:
    assert all(np.isfinite(r[f"rollout_corr/{n}"]) for n in names), r["step"]
    assert r["rollout_corr/num_tokens"] == sum(r.get(f"rollout_corr/lag{k}/num_tokens", 0) for k in (0, 1))
  assert any("rollout_corr/lag0/kl_k3" in r for r in rl)
  tags = {tag for _, tag in _tb_events(run_dir / "tb")}
  assert {f"rollout_corr/{n}" for n in names} <= tags and "rollout_corr/lag0/kl_k3" in tags


def test_held_out_evaluations_are_logged_at_the_step_they_were_taken(finished_run):
  """eval_every = 2: before RL (step 0), at steps 2 and 4 (greedy + pass@1), then 6 in the resumed run
  (greedy only: it resumed with eval_samples = 0). Checkpoints record the evaluation settings."""
  run_dir, first, second = finished_run
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in rows if "eval/accuracy" in r]
  assert [r["step"] for r in evals] == [0, 2, 4, 6]  # the last step's evaluation is not repeated
  assert all(0.0 <= r["eval/pass1_sampled"] <= 1.0 and r["time/eval"] > 0 for r in evals[:3])
  assert "eval/pass1_sampled" not in evals[3]
  manifest = lambda step: json.loads((run_dir / "checkpoints" / str(step) / "MANIFEST.json").read_text())
  assert manifest(4)["config"]["evaluation"] == {"size": 16, "every": 2, "samples": 2, "window": 3}
  assert manifest(6)["config"]["evaluation"]["samples"] == 0
  assert [e["step"] for e in first["evals"]] == [0, 2, 4] and [e["step"] for e in second["evals"]] == [6]
  assert first["eval_after_rl"] == first["evals"][-1]["eval/accuracy"]
  assert first["eval_accuracy_window"] == pytest.approx(np.mean([e["eval/accuracy"] for e in first["evals"][1:]]))
  assert (run_dir / "hf_export" / "config.json").exists() and (run_dir / "hf_export" / "tokenizer.json").exists()


def test_resume_continues_from_the_last_checkpoint(finished_run):
  run_dir, first, second = finished_run
  assert second["resumed_from_step"] == 4
  assert second["eval_before_rl"] == first["eval_before_rl"]  # the RL baseline is kept, not re-measured
  steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == 6 and len(steps) <= 2  # keep_checkpoints = 2 (base.gin)


def test_a_second_run_into_the_same_directory_refuses_to_overwrite(finished_run):
  run_dir, _, _ = finished_run
  with pytest.raises(FileExistsError, match="already holds checkpoints.*--resume"):
    _run(run_dir, steps=8)


def test_the_hf_export_scores_the_same_in_transformers(finished_run):
  """Logits of the exported model in PyTorch equal ours; greedy answers (hence rewards) agree."""
  torch = pytest.importorskip("torch")
  import transformers

  from llamarl_jax.model import hf
  from llamarl_jax.rewards.synthetic import score_arithmetic

  run_dir, _, _ = finished_run
  export = run_dir / "hf_export"
  tokenizer = transformers.AutoTokenizer.from_pretrained(export)
  ref = transformers.LlamaForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
  config, model = hf.load_hf_checkpoint(export)
  problems = [("3+4=", "7"), ("12-5=", "7"), ("9+9=", "18"), ("40-41=", "-1")]
  for prompt, truth in problems:
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
      ref_logits = ref(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(model(np.asarray([ids], np.int32)))
    np.testing.assert_allclose(ours, ref_logits, atol=1e-4, rtol=1e-4)  # fp32, tiny model
    out = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    ref_text = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    our_tokens = list(ids)
    for _ in range(8):  # greedy with our model, full forward each step
      nxt = int(np.argmax(np.asarray(model(np.asarray([our_tokens], np.int32)))[0, -1]))
      if nxt == tokenizer.eos_token_id:
        break
      our_tokens.append(nxt)
    our_text = tokenizer.decode(our_tokens[len(ids):], skip_special_tokens=True)
    assert our_text == ref_text
    assert score_arithmetic(our_text, truth) == score_arithmetic(ref_text, truth)


def test_a_tool_run_logs_every_episode_and_tool_metric_the_readme_lists(tmp_path):
  """configs/tiny_tools.gin (calculator episodes, static engine) for 2 RL steps after a short SFT whose
  teacher always calls the tool: every `tool/...` and `episode/...` metric README.md names is in every
  RL step's row of metrics.jsonl (the sandbox's statuses included, counted per batch)."""
  import re

  readme = (ROOT / "README.md").read_text()
  listed = set()
  for name in re.findall(r"`((?:tool|episode)/[a-z_]*(?:\{[a-z_,]+\}[a-z_]*)?)`", readme):
    head, _, rest = name.partition("{")
    listed |= {head + alt + rest.partition("}")[2] for alt in rest.partition("}")[0].split(",")} if rest else {name}
  assert {"tool/memory", "tool/output_limit", "tool/forbidden", "tool/latency_max_s", "episode/frac_cut"} <= listed
  small = ["ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
           "supervised_warmstart.steps = 20", "supervised_warmstart.batch_size = 16", "run_experiment.eval_size = 0",
           "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 4",
           "PromptSource.task_kwargs = {'min_digits': 3, 'max_digits': 3, 'num_operands': 2, 'ops': '*', "
           "'demo_tool': 'calc', 'demo_tool_rate': 1.0}"]
  run_dir = tmp_path / "run"
  _run(run_dir, steps=2, small=small, gin_file="tiny_tools.gin")
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  rl = [r for r in rows if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2]
  for r in rl:
    assert listed <= set(r), sorted(listed - set(r))
    assert r["tool/errors"] >= r["tool/timeouts"] + r["tool/memory"] + r["tool/output_limit"] + r["tool/forbidden"]


def test_rl_from_a_saved_qwen3_checkpoint(tmp_path):
  """scripts/train.py from an HF Qwen3 directory (random tiny weights, a ChatML tokenizer): prompts go
  through the chat template, 2 async RL steps train and sync weights, and the export is a Qwen3
  checkpoint that transformers loads as Qwen3ForCausalLM with our logits."""
  import torch
  import transformers
  from conftest import chatml_tokenizer, tiny_hf_model

  from llamarl_jax.model import hf

  checkpoint = tmp_path / "qwen3"
  tiny_hf_model("qwen3", vocab_size=128, num_hidden_layers=1, head_dim=16, tie_word_embeddings=True).save_pretrained(
      checkpoint)
  chatml_tokenizer().save_pretrained(checkpoint)
  small = ["run_experiment.eval_size = 4", "RolloutConfig.prompts_per_step = 2", "RolloutConfig.samples_per_prompt = 4",
           "TrainConfig.checkpoint_every = 2", "run_experiment.tensorboard = False", "run_experiment.sft = False",
           "run_experiment.eval_samples = 0",  # greedy evaluation only: the sampled one is tested above
           # ChatML-wrapped prompts are ~25 tokens: more than tiny_cpu.gin's 16-token slot-engine prompt bound
           "GeneratorConfig.max_prompt_len = 64"]
  run_dir = tmp_path / "run"
  summary = _run(run_dir, f"--gin_param=build_policy.model_path = '{checkpoint}'", steps=2, small=small)
  assert summary["samples_after"][0][0].startswith("<|im_start|>user\n")  # the checkpoint's chat template
  rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
  assert all(np.isfinite(r["loss/total"]) for r in rows if "loss/total" in r)
  export = run_dir / "hf_export"
  assert json.loads((export / "config.json").read_text())["model_type"] == "qwen3"
  ref = transformers.AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32).eval()
  assert type(ref) is transformers.Qwen3ForCausalLM
  config, model = hf.load_hf_checkpoint(export)
  ids = transformers.AutoTokenizer.from_pretrained(export)("<|im_start|>user\n3+4=<|im_end|>")["input_ids"]
  with torch.no_grad():
    theirs = ref(torch.tensor([ids])).logits.numpy()
  np.testing.assert_allclose(np.asarray(model(np.asarray([ids], np.int32))), theirs, atol=1e-4, rtol=0)


def test_a_prompt_longer_than_the_slot_engine_takes_is_refused_at_start_or_cut_and_counted(tmp_path, monkeypatch):
  """A JSONL file whose line 2 is a 601-token prompt, a 1024-position model, the slot engine (prompts up
  to min(512, context - response width) = 512 tokens by default): the run is refused before the
  Controller (and its engine's compilation) is built, the message naming the file, line and limit;
  with PromptSource.overlong_prompts = 'truncate' the prompt is cut to its last 512 tokens, counted in
  data/truncated_prompts, and the run completes. A file source has no held-out split: eval_size = 0
  needs none."""
  from llamarl_jax import experiment

  rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in ((3, 4), (12, 5), (7, 7), (20, 1),
                                                                              (9, 9), (1, 30), (2, 8))]
  rows.insert(1, {"question": "1+" * 300, "answer": "#### 300"})  # 600 characters: 601 tokens with BOS
  data = tmp_path / "rows.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  small = ["ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
           "ModelConfig.max_position_embeddings = 1024", "GeneratorConfig.max_prompt_len = None",
           "run_experiment.sft = False", "run_experiment.eval_size = 0", "run_experiment.tensorboard = False",
           "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 4",
           f"PromptSource.files = '{data}'", "PromptSource.reward = 'arithmetic'"]

  def unbuilt(*args, **kwargs):
    raise AssertionError("the Controller was built before the prompts were checked")

  with monkeypatch.context() as m:
    m.setattr(experiment, "Controller", unbuilt)
    with pytest.raises(ValueError, match=r"max_prompt_tokens = 512 .*rows\.jsonl:2 \(601 tokens\)"):
      _run(tmp_path / "refused", steps=2, small=small)
  assert not (tmp_path / "refused" / "metrics.jsonl").exists()
  run_dir = tmp_path / "cut"
  _run(run_dir, steps=2, small=small + ["PromptSource.overlong_prompts = 'truncate'"])
  rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2] and rl[-1]["data/truncated_prompts"] == 1


def test_tool_episodes_that_outgrow_the_slot_engine_run_to_completion(tmp_path):
  """configs/tiny_tools.gin on the slot engine with prompts of at most 9 tokens (the prompts' length)
  and an episode width of 23: the engine takes later turns of at most 16 tokens, so every episode that
  calls the calculator (200 SFT steps on a teacher that always does: 12 calls in 16 rows here) outgrows
  it after the observation and ends cut; the run completes."""
  small = ["ModelConfig.hidden_size = 32", "ModelConfig.intermediate_size = 64", "ModelConfig.num_layers = 2",
           "supervised_warmstart.steps = 200", "supervised_warmstart.batch_size = 16", "run_experiment.eval_size = 0",
           "RolloutConfig.prompts_per_step = 4", "RolloutConfig.samples_per_prompt = 4",
           "GeneratorConfig.engine = 'slots'", "GeneratorConfig.max_prompt_len = 9", "EnvConfig.max_total_tokens = 23",
           "PromptSource.task_kwargs = {'min_digits': 3, 'max_digits': 3, 'num_operands': 2, 'ops': '*', "
           "'demo_tool': 'calc', 'demo_tool_rate': 1.0}"]
  run_dir = tmp_path / "run"
  _run(run_dir, steps=2, small=small, gin_file="tiny_tools.gin")
  rl = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
  assert [r["step"] for r in rl] == [1, 2]
  for r in rl:  # a row that called the calculator is cut (its next prompt is too long): at least as many cut
    assert r["tool/calls"] > 0 and r["episode/turns_max"] == 1 and r["episode/frac_cut"] >= r["tool/calls"] / 16, r
