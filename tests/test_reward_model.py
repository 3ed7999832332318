"""Specification of llamarl_jax.rewards.RewardModel: Hugging Face `*ForSequenceClassification`
checkpoints (one label) in and out, scores equal to transformers' on the same weights.

Tolerance: fp32 on both sides, a 2-layer model of width 32; the two implementations differ only in
the order of float32 sums (attention, matmuls), ~1e-6 relative on O(1) scores, so atol = rtol = 1e-4
(the bound the acceptance criterion names) has wide margin and still catches any misplaced weight or
wrong read position (those move scores by O(0.1)).
"""

import json

import jax
import numpy as np
import pytest

from conftest import HF_CLASSES, mesh_at_most, tiny_hf_config
from llamarl_jax import compat
from llamarl_jax import rewards
from llamarl_jax.model.hf import CheckpointError, load_hf_checkpoint
from llamarl_jax.rewards.reward_model import RewardModel, score_positions

PAD = 0
TOL = dict(rtol=1e-4, atol=1e-4)


def tiny_hf_classifier(family="llama", seed=0, pad_token_id=PAD, **overrides):
  """A random transformers `*ForSequenceClassification` (num_labels = 1), fp32, eval mode, with random
  norm scales and biases (transformers' 1 and 0 would hide a misplaced norm or bias)."""
  import torch
  import transformers

  torch.manual_seed(seed)
  cls = getattr(transformers, HF_CLASSES[family][1].replace("ForCausalLM", "ForSequenceClassification"))
  model = cls(tiny_hf_config(family, num_labels=1, pad_token_id=pad_token_id, **overrides)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):
        p.normal_(0.0, 0.1)
      elif "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      elif name == "score.weight":
        p.normal_(0.0, 1.0)  # scores of O(1)
  return model


def torch_scores(model, rows, pad=PAD):
  """transformers' logits `[N]` of rows right-padded with `pad` to the longest (its own read position)."""
  import torch

  width = max(len(r) for r in rows)
  ids = torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows])
  with torch.no_grad():
    return model(input_ids=ids).logits[:, 0].numpy()


def random_rows(lengths, seed=0, vocab=67):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, size=n).tolist() for n in lengths]  # ids >= 1: no pad inside


@pytest.fixture
def saved_classifier(tmp_path):
  def make(family="llama", seed=0):
    model = tiny_hf_classifier(family, seed)
    model.save_pretrained(tmp_path / family)
    return model, tmp_path / family

  return make


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_scores_equal_transformers_on_right_padded_rows(saved_classifier, family):
  torch_model, path = saved_classifier(family)
  rm = RewardModel.from_pretrained(path)
  rows = random_rows([5, 17, 1, 9, 30])
  # A row ending in pad ids is read before them, as transformers reads it (the pad rule, not the length).
  rows.append(rows[0] + [PAD, PAD])
  ours = rm.score_tokens(rows)
  np.testing.assert_allclose(ours, torch_scores(torch_model, rows), **TOL)
  assert ours[-1] == pytest.approx(ours[0], abs=1e-5)
  assert np.ptp(ours) > 0.1  # the rows really differ: a constant score would not pass by accident


def test_save_loads_back_in_transformers_with_equal_logits(saved_classifier, tmp_path):
  import transformers

  _, path = saved_classifier("qwen2")
  rm = RewardModel.from_pretrained(path)
  out = rm.save_pretrained(tmp_path / "ours")
  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config["architectures"] == ["Qwen2ForSequenceClassification"] and hf_config["pad_token_id"] == PAD
  reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(out).eval()
  assert type(reloaded).__name__ == "Qwen2ForSequenceClassification" and reloaded.config.num_labels == 1
  rows = random_rows([3, 12, 7], seed=1)
  np.testing.assert_allclose(torch_scores(reloaded, rows), rm.score_tokens(rows), **TOL)
  # and ours loads our own export to the same scores (bit-identical: the same fp32 weights)
  np.testing.assert_array_equal(RewardModel.from_pretrained(out).score_tokens(rows), rm.score_tokens(rows))


@pytest.mark.devices(4)
def test_sharded_like_the_policy_gives_the_same_scores(saved_classifier):
  _, path = saved_classifier("llama")
  rows = random_rows([4, 11, 2, 20, 8], seed=2)
  one = RewardModel.from_pretrained(path).score_tokens(rows)
  mesh = mesh_at_most(fsdp=2, tp=2)
  rm = RewardModel.from_pretrained(path, mesh=mesh)
  # wq [layers, embed, heads, head_dim]: the policy's rules (embed over fsdp, heads over tp)
  assert rm.params["layers"]["attn"]["wq"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp", None)
  # Sharded sums reorder float32 additions: ~1e-6.
  np.testing.assert_allclose(rm.score_tokens(rows), one, rtol=1e-5, atol=1e-5)


def test_values_are_the_head_at_every_position(saved_classifier):
  _, path = saved_classifier("llama")
  rm = RewardModel.from_pretrained(path)
  rows = random_rows([6, 13, 3], seed=3)
  tokens = np.zeros((3, 13), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  lengths = np.array([len(r) for r in rows])
  values = rm.values(tokens, lengths)
  assert values.shape == (3, 13)
  # V at a row's last token is its score; V at token t is the score of the row's first t + 1 tokens.
  np.testing.assert_allclose(values[np.arange(3), lengths - 1], rm.score_tokens(rows), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(values[1, 4], rm.score_tokens([rows[1][:5]])[0], rtol=1e-5, atol=1e-5)


def test_values_equal_transformers_per_token_head(saved_classifier):
  """The critic's per-token values are transformers' `score(hidden_states)` before its pooling."""
  import torch

  torch_model, path = saved_classifier("qwen2")
  rows = random_rows([9, 4], seed=6)
  tokens = np.zeros((2, 9), np.int64)
  tokens[1, :4] = rows[1]
  tokens[0] = rows[0]
  with torch.no_grad():
    hidden = torch_model.model(input_ids=torch.tensor(tokens)).last_hidden_state
    want = torch_model.score(hidden)[..., 0].numpy()
  values = RewardModel.from_pretrained(path).values(tokens, np.array([9, 4]))
  np.testing.assert_allclose(values[0], want[0], **TOL)
  np.testing.assert_allclose(values[1, :4], want[1, :4], **TOL)  # past a row's length: not meaningful


def test_few_programs_for_many_lengths(saved_classifier):
  _, path = saved_classifier("llama")
  rm = RewardModel.from_pretrained(path, batch_rows=8)
  rng = np.random.default_rng(4)
  for _ in range(6):  # batches of 8 rows, lengths 1..31: widths 16 and 32, one row count
    rm.score_tokens(random_rows(rng.integers(1, 32, size=8), seed=int(rng.integers(1 << 30))))
  assert compat.jit_cache_size(rm._scores) <= 2
  # 20 rows = chunks of 8, 8, 4: one more row count; scores equal those of the rows one at a time
  rows = random_rows(rng.integers(1, 32, size=20), seed=5)
  np.testing.assert_allclose(rm.score_tokens(rows), np.concatenate([rm.score_tokens([r]) for r in rows]),
                             rtol=1e-5, atol=1e-5)


def test_score_texts_uses_the_chat_template(tmp_path):
  from conftest import chatml_tokenizer

  tok = chatml_tokenizer()
  torch_model = tiny_hf_classifier("qwen2", pad_token_id=tok.pad_token_id, vocab_size=len(tok))
  torch_model.save_pretrained(tmp_path / "rm")
  rm = rewards.RewardModel.from_pretrained(tmp_path / "rm", tokenizer=tok)
  assert rm.pad_id == tok.pad_token_id
  prompts, replies = ["1+1?", "2+3?"], ["2", "six"]
  scores = rm.score(replies, prompts)
  rows = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                  tokenize=False) for p, r in zip(prompts, replies)]
  assert rows[0] == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
  np.testing.assert_allclose(scores, torch_scores(torch_model, [tok(r)["input_ids"] for r in rows],
                                                  tok.pad_token_id), **TOL)
  # a conversation given whole scores the same
  conv = [[{"role": "user", "content": prompts[0]}, {"role": "assistant", "content": replies[0]}]]
  np.testing.assert_allclose(rm.score(conv), scores[:1], rtol=1e-6)


def test_score_positions_follow_transformers_rule():
  assert score_positions([[5, 6, 7], [5, 0, 7], [5, 6, 0, 0], [0, 0]], pad_id=0).tolist() == [2, 2, 1, 0]
  assert score_positions([[5, 6, 0, 0]], pad_id=None).tolist() == [3]


def test_bad_inputs_are_named(saved_classifier, make_hf_model):
  _, path = saved_classifier("llama")
  rm = RewardModel.from_pretrained(path)
  with pytest.raises(ValueError, match="row 1 is empty"):
    rm.score_tokens([[1, 2], []])
  with pytest.raises(ValueError, match=r"row 0 has 200 tokens, more than the reward model's context"):
    rm.score_tokens([[1] * 200])
  with pytest.raises(ValueError, match=r"outside \[0, 67\)"):
    rm.score_tokens([[1, 99]])
  with pytest.raises(ValueError, match="has no tokenizer"):
    rm.score(["hello"])
  _, causal = make_hf_model("causal")
  with pytest.raises(CheckpointError, match="is a causal LM, not a reward model"):
    RewardModel.from_pretrained(causal)
  # the causal LM still loads as one (the classifier support leaves it alone)
  assert load_hf_checkpoint(causal)[0].num_labels == 0


def test_bench_reward_model_reports_throughput_and_padding(capsys):
  import importlib.util
  from pathlib import Path

  script = Path(__file__).resolve().parents[1] / "scripts" / "bench_reward_model.py"
  spec = importlib.util.spec_from_file_location("bench_reward_model", script)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  rows = bench.main(["--sizes", "32x1", "--rows", "8", "--batch_rows", "4", "--repeats", "2", "--max_len", "40"])
  assert [(r["model"], r["rows"]) for r in rows] == [("32x1", 8)]
  assert rows[0]["rows_per_s"] > 0 and 0 <= rows[0]["padded"] < 1
  assert 1 <= rows[0]["programs"] <= 3  # 2 chunks of 4 rows at widths 16 / 32 / 64 at most
  assert "tokens/s" in capsys.readouterr().out
