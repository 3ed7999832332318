"""Specification of reward-model training: `losses.bradley_terry_loss`, preference pairs
(`rewards.preferences`), `scripts/train_rm.py` (Bradley-Terry steps raise held-out pairwise accuracy;
its export loads in transformers with logits equal to our scores; bad pairs files are clear errors)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import losses
from llamarl_jax.rewards import preferences, synthetic
from llamarl_jax.rewards.preferences import PairsError, PreferencePair, read_pairs, write_pairs

TASK = synthetic.ArithmeticTask(min_digits=1, max_digits=2, num_operands=2, ops="+")  # make run's task


# ------------------------------------------------------------------------------------------------
# the loss


def test_bradley_terry_loss_equals_hand_derived_values():
  # d = chosen - rejected = [2, 0, -2] on the valid pairs; the 4th pair is masked (and NaN there).
  # loss = mean(log(1 + e^-d)) = (log(1 + e^-2) + log 2 + log(1 + e^2)) / 3
  #      = (0.1269280110 + 0.6931471806 + 2.1269280110) / 3 = 0.9823344009
  # d loss / d chosen_i = -sigmoid(-d_i) / 3 = -[0.1192029220, 0.5, 0.8807970780] / 3; masked: 0
  chosen = jnp.array([2.0, 0.0, 1.0, jnp.nan])
  rejected = jnp.array([0.0, 0.0, 3.0, 5.0])
  mask = jnp.array([1, 1, 1, 0])
  loss, metrics = losses.bradley_terry_loss(chosen, rejected, mask)
  np.testing.assert_allclose(loss, 0.9823344009, rtol=1e-6)
  assert float(metrics["rm/accuracy"]) == 0.5  # 1 + 1/2 (the tie) + 0, over 3 pairs
  np.testing.assert_allclose(metrics["rm/margin_mean"], 0.0, atol=1e-7)
  np.testing.assert_allclose(metrics["rm/chosen_mean"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(metrics["rm/rejected_mean"], 1.0, rtol=1e-6)
  assert float(metrics["rm/num_pairs"]) == 3.0
  grad_c, grad_r = jax.grad(lambda c, r: losses.bradley_terry_loss(c, r, mask)[0], argnums=(0, 1))(chosen, rejected)
  expected = -np.array([0.1192029220, 0.5, 0.8807970780, 0.0]) / 3
  np.testing.assert_allclose(grad_c, expected, rtol=1e-6, atol=1e-9)
  np.testing.assert_allclose(grad_r, -expected, rtol=1e-6, atol=1e-9)


def test_bradley_terry_margin_and_empty_batch():
  # margin m: log(1 + e^(m - d)); d = 1, m = 1 -> log 2
  loss, _ = losses.bradley_terry_loss(jnp.array([1.0]), jnp.array([0.0]), margin=1.0)
  np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
  loss, metrics = losses.bradley_terry_loss(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2))
  assert float(loss) == 0.0 and float(metrics["rm/num_pairs"]) == 0.0


# ------------------------------------------------------------------------------------------------
# pairs


def test_arithmetic_pairs_prefer_the_verified_answer_and_split_prompts():
  train = preferences.arithmetic_pairs(TASK, seed=0, count=600, split="train")
  heldout = preferences.arithmetic_pairs(TASK, seed=0, count=100, split="heldout")
  for p in train + heldout:
    truth = str(eval(p.prompt[:-1]))  # noqa: S307 - the test's own "a+b" prompts, an independent answer
    assert p.chosen == truth and synthetic.score_arithmetic(p.chosen, truth) == 1.0
    assert synthetic.score_arithmetic(p.rejected, truth) == 0.0
  assert not {p.prompt for p in train} & {p.prompt for p in heldout}
  assert all(synthetic.split_of(p.prompt) == "heldout" for p in heldout)
  kinds = {"format": sum(p.rejected == "ans " + p.chosen for p in train)}
  assert 0.13 < kinds["format"] / len(train) < 0.27  # REJECTIONS: 20% the right answer in the teacher's format
  assert preferences.arithmetic_pairs(TASK, seed=0, count=600, split="train") == train  # deterministic
  assert all(p.kind == "format" for p in train if p.rejected == "ans " + p.chosen)


def test_pairs_round_trip_with_and_without_kind(tmp_path):
  pairs = [PreferencePair("1+1=", "2", "ans 2", "format"), PreferencePair("2+2=", "4", "5")]
  write_pairs(pairs, tmp_path / "p.jsonl")
  assert "kind" not in (tmp_path / "p.jsonl").read_text().splitlines()[1]
  assert read_pairs(tmp_path / "p.jsonl") == pairs


@pytest.mark.parametrize("content, problem", [
    ("", "holds no preference pairs (an empty file)"),
    ("\n\n", "holds no preference pairs (an empty file)"),
    ('{"prompt": "1+1=", "chosen": "2"}\n', ":1: missing key(s) ['rejected']"),
    ('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2="\n', ":2: not valid JSON"),
    ('["1+1=", "2", "3"]\n', ":1: expected a JSON object with keys ['prompt', 'chosen', 'rejected']"),
    ('{"prompt": "1+1=", "chosen": 2, "rejected": "3"}\n', ":1: prompt, chosen and rejected must be strings (chosen is int)"),
    ('{"prompt": "1+1=", "chosen": "2", "rejected": "2"}\n', ":1: chosen and rejected are the same text"),
])
def test_bad_pairs_files_are_clear_errors(tmp_path, content, problem):
  path = tmp_path / "pairs.jsonl"
  path.write_text(content)
  with pytest.raises(PairsError) as e:
    read_pairs(path)
  assert problem in str(e.value) and str(path) in str(e.value)


def test_missing_pairs_file_and_script_error(tmp_path, capsys):
  from scripts import train_rm

  with pytest.raises(PairsError, match="does not exist"):
    read_pairs(tmp_path / "nope.jsonl")
  (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "chosen": "2"}\n')
  with pytest.raises(SystemExit) as e:  # the script: one message, no traceback
    train_rm.main(["--pairs", str(tmp_path / "bad.jsonl"), "--tiny", "--run_dir", str(tmp_path / "rm")])
  assert "bad.jsonl:1: missing key(s) ['rejected']" in str(e.value.code)
  assert not (tmp_path / "rm").exists()  # nothing written


# ------------------------------------------------------------------------------------------------
# training and export

HELDOUT = 64


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """train_rm from a tiny random policy (an HF causal LM with the character tokenizer) on pairs whose
  rejected response is in the wrong format ("ans " + a number): 40 steps of 16 pairs, then the held-out
  pairs (other prompts). Returns (summary, held-out pairs, the policy's directory)."""
  from flax import nnx

  from llamarl_jax.model import hf
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import Llama
  from llamarl_jax.tokenizer import make_char_tokenizer
  from scripts import train_rm

  tmp = tmp_path_factory.mktemp("train_rm")
  tokenizer = make_char_tokenizer()
  config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=32, rope_theta=10000.0, tie_word_embeddings=True)
  hf.save_hf_checkpoint(Llama(config, rngs=nnx.Rngs(params=0)), config, tmp / "policy", tokenizer=tokenizer)
  wrong_format = lambda pairs: [p for p in pairs if p.rejected.startswith("ans ")]
  train = wrong_format(preferences.arithmetic_pairs(TASK, seed=0, count=1200, split="train"))
  heldout = wrong_format(preferences.arithmetic_pairs(TASK, seed=0, count=200, split="heldout"))[:HELDOUT]
  write_pairs(train, tmp / "train.jsonl")
  write_pairs(heldout, tmp / "heldout.jsonl")
  summary = train_rm.main(["--pairs", str(tmp / "train.jsonl"), "--heldout_pairs", str(tmp / "heldout.jsonl"),
                           "--init", str(tmp / "policy"), "--run_dir", str(tmp / "rm"), "--steps", "40",
                           "--batch_pairs", "16", "--lr", "3e-3", "--warmup_steps", "5", "--eval_every", "0",
                           "--log_every", "10", "--no_progress"])
  return summary, heldout, tmp


def test_train_rm_raises_heldout_pairwise_accuracy(trained):
  summary, heldout, tmp = trained
  assert summary["heldout_pairs"] == HELDOUT
  # A random score head gives about chance (0.5); chance's standard deviation over 64 pairs is
  # sqrt(0.25 / 64) = 0.0625, so 0.9 is more than 6 standard deviations above it. The rejected rows
  # all carry "ans " (the training signal to learn); the held-out prompts are not in training.
  assert abs(summary["heldout_accuracy_before"] - 0.5) < 0.25
  assert summary["heldout_accuracy_after"] >= 0.9
  assert summary["skipped_nonfinite"] == 0
  rows = [json.loads(line) for line in (tmp / "rm" / "metrics.jsonl").read_text().splitlines()]
  train_rows = [r for r in rows if "rm/accuracy" in r]
  assert [r["step"] for r in train_rows] == [10, 20, 30, 40]
  assert train_rows[-1]["loss/total"] < train_rows[0]["loss/total"]
  assert [r["step"] for r in rows if "eval/rm_accuracy" in r] == [0, 40]
  kinds = {p.kind for p in heldout}  # the pairs name their kinds: accuracy per kind too
  assert kinds == {"format", "format_wrong"} and set(summary["heldout_accuracy_by_kind"]) == kinds
  assert rows[-1]["eval/rm_accuracy"] == pytest.approx(np.mean([
      rows[-1][f"eval/rm_accuracy/{k}"] for p in heldout for k in [p.kind]]))


def test_export_loads_in_transformers_with_our_scores(trained):
  """transformers' LlamaForSequenceClassification logits on the export equal `RewardModel`'s scores
  (fp32 both sides: they differ only in the order of float32 sums, ~1e-6 on O(1) scores; 1e-4 catches
  a misplaced weight or read position, which moves scores by O(0.1)), and their held-out margin equals
  the one train_rm measured with its training forward before export."""
  import torch
  import transformers

  from llamarl_jax.rewards.reward_model import RewardModel
  from llamarl_jax.train.reward_model import response_row

  summary, heldout, tmp = trained
  export = tmp / "rm" / "hf_export"
  model = transformers.AutoModelForSequenceClassification.from_pretrained(export, torch_dtype=torch.float32).eval()
  assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
  tokenizer = transformers.AutoTokenizer.from_pretrained(export)
  rows = [response_row(tokenizer, p.prompt, r) for p in heldout for r in (p.chosen, p.rejected)]
  width = max(map(len, rows))
  ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
  with torch.no_grad():
    theirs = model(input_ids=ids).logits[:, 0].numpy()
  ours = RewardModel.from_pretrained(export).score_tokens(rows)
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
  margin = float(np.mean(theirs[0::2] - theirs[1::2]))
  np.testing.assert_allclose(margin, summary["heldout_margin_after"], rtol=1e-4, atol=1e-4)
  accuracy = float(np.mean((theirs[0::2] > theirs[1::2]) + 0.5 * (theirs[0::2] == theirs[1::2])))
  assert accuracy == summary["heldout_accuracy_after"]


def test_reward_model_params_from_a_policy():
  from llamarl_jax.model.config import ModelConfig
  from llamarl_jax.model.llama import init_model, split_params
  from llamarl_jax.train.reward_model import reward_model_params

  config = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       max_position_embeddings=16)  # untied: the policy has an lm_head
  params = split_params(init_model(config))[1]
  rm_config, rm_params = reward_model_params(config, params, seed=1)
  assert rm_config.num_labels == 1 and "lm_head" in params and "lm_head" not in rm_params
  assert rm_params["score"].shape == (16, 1) and 0.005 < float(jnp.std(rm_params["score"])) < 0.05  # N(0, 0.02)
  np.testing.assert_array_equal(rm_params["embed"], params["embed"])
  assert reward_model_params(rm_config, rm_params) == (rm_config, rm_params)  # one label: unchanged
  with pytest.raises(ValueError, match="reward model has one score"):
    reward_model_params(config.replace(num_labels=2), params)


def test_heldout_fraction_splits_by_prompt(tmp_path):
  from scripts.train_rm import split_by_prompt

  pairs = [PreferencePair(f"{i % 50}+1=", str(i % 50 + 1), "x") for i in range(400)]
  train, heldout = split_by_prompt(pairs, 0.2)
  assert len(train) + len(heldout) == 400 and 0.05 < len(heldout) / 400 < 0.4
  assert not {p.prompt for p in train} & {p.prompt for p in heldout}
