"""PromptSource: GSM8K/MATH/user-field files (jsonl, parquet), synthetic streams, templates, resumption."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llamarl_jax.data import PromptExample, PromptSource, read_located_rows
from llamarl_jax.tokenizer import make_char_tokenizer

DATA = Path(__file__).parent / "data"
GSM8K = DATA / "gsm8k_sample.jsonl"
MATH = DATA / "math_sample.jsonl"



def read_rows(path) -> list[dict]:
  """Rows of a prompt file as dicts; a malformed row raises naming file and line."""
  rows = []
  for where, row in read_located_rows(path):
    if isinstance(row, str):
      raise ValueError(f"{where}: {row}")
    rows.append(row)
  return rows

def _key(ex: PromptExample):
  return (ex.index, ex.prompt, ex.ground_truth)


def test_gsm8k_fields_and_ground_truth():
  src = PromptSource(GSM8K, shuffle=False)
  ex = src.next_batch(1)[0]
  assert ex.question.startswith("Mia buys 3 packs") and ex.prompt == ex.question
  assert (ex.ground_truth, ex.task, ex.index) == ("27", "math", 0)
  assert src.reference(ex).endswith("#### 27")
  assert len(src) == 12


def test_math_fields_use_the_last_box_and_skip_rows_without_one():
  src = PromptSource(MATH, shuffle=False)
  assert len(src) == 11 and src.skipped_rows == 1
  truths = [ex.ground_truth for ex in src.next_batch(11)]
  assert truths[:3] == [r"\frac{5}{6}", "5", r"5\sqrt{2}"]


def test_user_named_fields(tmp_path):
  path = tmp_path / "custom.jsonl"
  path.write_text("\n".join(json.dumps({"q": f"What is {i}+{i}?", "a": str(2 * i)}) for i in range(5)))
  src = PromptSource(path, prompt_field="q", answer_field="a", reward="my_reward", shuffle=False)
  assert [(ex.question, ex.ground_truth, ex.task) for ex in src.next_batch(2)] == [
      ("What is 0+0?", "0", "my_reward"), ("What is 1+1?", "2", "my_reward")]
  with pytest.raises(ValueError, match="prompt_field"):
    PromptSource(path)


def test_parquet_matches_jsonl(tmp_path):
  rows = read_rows(GSM8K)
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "gsm8k.parquet")
  a = PromptSource(GSM8K, seed=5).next_batch(30)
  b = PromptSource(tmp_path / "gsm8k.parquet", seed=5).next_batch(30)
  assert [_key(x) for x in a] == [_key(x) for x in b]


def test_multiple_files_and_globs():
  src = PromptSource(str(DATA / "*_sample.jsonl"), shuffle=False)
  assert len(src) == 12 + 11
  assert {ex.ground_truth for ex in src.next_batch(23)} >= {"27", r"\frac{5}{6}"}


def test_shuffle_is_seeded_and_each_epoch_is_a_permutation():
  src = PromptSource(GSM8K, seed=1)
  epoch0, epoch1 = src.next_batch(12), src.next_batch(12)
  assert sorted(ex.index for ex in epoch0) == list(range(12)) == sorted(ex.index for ex in epoch1)
  assert [ex.index for ex in epoch0] != [ex.index for ex in epoch1]  # reshuffled each epoch
  assert [ex.index for ex in PromptSource(GSM8K, seed=1).next_batch(24)] == [ex.index for ex in epoch0 + epoch1]
  assert [ex.index for ex in PromptSource(GSM8K, seed=2).next_batch(12)] != [ex.index for ex in epoch0]


def test_finite_epochs_run_out():
  src = PromptSource(GSM8K, num_epochs=1)
  assert len(src.next_batch(10)) == 10 and len(src.next_batch(10)) == 2 and src.next_batch(10) == []


@pytest.mark.parametrize("make", [
    lambda: PromptSource(GSM8K, seed=3),
    lambda: PromptSource([GSM8K, MATH], seed=4, shuffle=True),
    lambda: PromptSource(task="arithmetic", seed=7),
    lambda: PromptSource(task="countdown", task_kwargs=dict(num_numbers=4), seed=8),
], ids=["gsm8k", "two-files", "arithmetic", "countdown"])
def test_resume_from_state_yields_exactly_the_next_prompts(make):
  reference = make()
  reference.next_batch(7)
  state = json.loads(json.dumps(reference.state_dict()))  # the state is JSON (stored in checkpoints)
  expected = reference.next_batch(13) + reference.next_batch(40)  # crosses epoch boundaries for files

  resumed = make()
  resumed.next_batch(3)  # wherever it was: loading the state decides
  resumed.load_state_dict(state)
  got = resumed.next_batch(13) + resumed.next_batch(40)
  assert [_key(x) for x in got] == [_key(x) for x in expected]


def test_state_from_another_source_is_rejected():
  state = PromptSource(GSM8K, seed=3).state_dict()
  with pytest.raises(ValueError, match="does not match"):
    PromptSource(GSM8K, seed=4).load_state_dict(state)
  with pytest.raises(ValueError, match="does not match"):
    PromptSource(task="arithmetic").load_state_dict(state)


def test_synthetic_source_defaults_to_arithmetic():
  src = PromptSource()
  batch = src.next_batch(4)
  assert [ex.index for ex in batch] == [0, 1, 2, 3]
  for ex in batch:
    assert ex.task == "arithmetic" and ex.prompt.endswith("=") and src.reference(ex) == ex.ground_truth


def test_heldout_never_overlaps_training():
  train = PromptSource(task="arithmetic", task_kwargs=dict(min_digits=2, max_digits=2))
  heldout = train.heldout()
  assert not {ex.prompt for ex in train.next_batch(500)} & {ex.prompt for ex in heldout.next_batch(100)}
  files = PromptSource([GSM8K, MATH], heldout_fraction=0.3)
  held = files.heldout()
  assert len(files) + len(held) == 23 and len(held) > 0
  assert not {ex.index for ex in files.next_batch(len(files))} & {ex.index for ex in held.next_batch(100)}
  with pytest.raises(ValueError, match="heldout_fraction"):
    PromptSource(GSM8K).heldout()


def test_fork_changes_the_seed_only():
  src = PromptSource(task="arithmetic", seed=0)
  fork = src.fork(seed_offset=1)
  assert fork.next_batch(20) == PromptSource(task="arithmetic", seed=1).next_batch(20)


def test_plain_template_and_encode():
  tok = make_char_tokenizer()
  src = PromptSource(task="arithmetic", template="Q:{prompt}", tokenizer=tok)
  ex = src.next_batch(1)[0]
  assert ex.prompt == "Q:" + ex.question and not ex.chat
  assert ex.encode(tok) == [tok.bos_token_id] + tok(ex.prompt, add_special_tokens=False)["input_ids"]


def test_chat_template_when_the_tokenizer_has_one():
  tok = make_char_tokenizer()
  tok.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
  src = PromptSource(GSM8K, shuffle=False, tokenizer=tok, system_prompt="Be brief.",
                     template="{prompt} Answer after ####.")
  ex = src.next_batch(1)[0]
  assert ex.chat
  assert ex.prompt == f"<bos><system>Be brief.\n<user>{ex.question} Answer after ####.\n<assistant>"
  ids = ex.encode(tok)
  assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id  # the template's <bos>, not a second one
  plain = PromptSource(GSM8K, shuffle=False, tokenizer=tok, use_chat_template=False).next_batch(1)[0]
  assert not plain.chat and plain.prompt == plain.question


def test_qwen_chatml_template_from_the_checkpoint_tokenizer(make_hf_model):
  """A Qwen checkpoint's own tokenizer (ChatML, no BOS), loaded as the job loads it, formats and encodes
  prompts the Qwen way; the stop token the Controller uses (eos) is <|im_end|>, the end of a turn."""
  from conftest import chatml_tokenizer
  from llamarl_jax.experiment import build_policy

  _, path = make_hf_model(family="qwen3", vocab_size=128)
  chatml_tokenizer().save_pretrained(path)
  config, _, tok = build_policy(model_path=str(path))
  assert config.model_type == "qwen3"
  src = PromptSource(GSM8K, shuffle=False, system_prompt="Be brief.", template="{prompt} Answer after ####.")
  ex = src.with_tokenizer(tok).next_batch(1)[0]
  assert ex.chat
  assert ex.prompt == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{ex.question} Answer after "
                       "####.<|im_end|>\n<|im_start|>assistant\n")
  ids = ex.encode(tok)
  start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
  assert ids[0] == start and ids.count(start) == 3 and ids.count(end) == 2  # one id each, no BOS before
  assert tok.decode(ids) == ex.prompt and tok.eos_token_id == end


def test_with_tokenizer_keeps_the_position():
  src = PromptSource(GSM8K, seed=2)
  src.next_batch(5)
  other = src.with_tokenizer(make_char_tokenizer())
  assert [_key(x) for x in other.next_batch(5)] == [_key(x) for x in src.next_batch(5)]


def test_bad_inputs_have_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError):
    PromptSource(tmp_path / "missing.jsonl")
  (tmp_path / "x.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match="unsupported"):
    PromptSource(tmp_path / "x.csv")
  (tmp_path / "odd.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
  with pytest.raises(ValueError, match="prompt_field"):
    PromptSource(tmp_path / "odd.jsonl")
  with pytest.raises(ValueError, match="template"):
    PromptSource(template="no placeholder")


# ---- bad rows and the context limit ----

def _write_lines(path, lines):
  path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
  return path


def test_a_first_row_without_an_answer_does_not_reject_the_file(tmp_path):
  f = _write_lines(tmp_path / "g.jsonl", [{"question": "q0"}, {"question": "1+1?", "answer": "so #### 2"},
                                          {"question": "2+2?", "answer": "so #### 4"}])
  src = PromptSource(f, shuffle=False)
  assert [ex.ground_truth for ex in src.next_batch(2)] == ["2", "4"]
  assert src.skipped_rows == 1 and dict(src.skip_reasons) == {"no answer": 1}


def test_bad_rows_error_names_file_and_line(tmp_path):
  f = _write_lines(tmp_path / "g.jsonl", [{"question": "1+1?", "answer": "#### 2"}, ["a", "list"],
                                          "{not json", {"question": "3+3?", "answer": "no marker"}])
  with pytest.raises(ValueError, match=r"g\.jsonl:2: expected a JSON object, found a JSON list"):
    PromptSource(f, bad_rows="error")
  with pytest.raises(ValueError, match=r"g\.jsonl:2: expected a JSON object"):
    read_rows(f)
  src = PromptSource(f, bad_rows="skip")
  assert len(src) == 1 and src.skipped_rows == 3
  assert dict(src.skip_reasons) == {"expected a JSON object, found a JSON list": 1, "not valid JSON": 1,
                                    "no ground truth in the answer": 1}
  assert src.counters()["data/skipped_rows"] == 3


def test_overlong_prompts_error_at_start_up_or_truncate_and_count(tmp_path):
  tok = make_char_tokenizer()
  long_q = "1+" * 30 + "1"  # 61 characters -> 62 tokens with BOS
  f = _write_lines(tmp_path / "g.jsonl", [{"question": "1+1", "answer": "#### 2"},
                                          {"question": long_q, "answer": "#### 31"}])
  src = PromptSource(f, shuffle=False).with_tokenizer(tok)
  with pytest.raises(ValueError, match=r"g\.jsonl:2 \(62 tokens\).*overlong_prompts = 'truncate'"):
    src.limit_prompts(40)
  cut = PromptSource(f, shuffle=False, overlong_prompts="truncate").with_tokenizer(tok)
  cut.limit_prompts(40)
  a, b = cut.next_batch(2)
  assert len(a.encode(tok)) == 4 and b.encode(tok) == tok(b.prompt)["input_ids"][-40:]
  assert cut.counters()["data/truncated_prompts"] == 1
  assert cut.fork().max_prompt_tokens == 40  # the limit travels with forks (and heldout / with_tokenizer)
  restored = PromptSource(f, shuffle=False, overlong_prompts="truncate").with_tokenizer(tok)
  restored.load_state_dict(cut.state_dict())
  assert restored.truncated_prompts == 1


def test_synthetic_prompts_past_the_limit_fail_when_drawn():
  src = PromptSource(task="arithmetic", seed=0).with_tokenizer(make_char_tokenizer())
  src.limit_prompts(3)
  with pytest.raises(ValueError, match=r"max_prompt_tokens = 3.*arithmetic example 0 \(7 tokens\)"):
    src.next_batch(1)


def test_a_file_of_only_malformed_lines_is_reported_by_line(tmp_path):
  f = _write_lines(tmp_path / "g.jsonl", ["[1, 2]", "oops"])
  with pytest.raises(ValueError, match=r"g\.jsonl:1: expected a JSON object, found a JSON list"):
    PromptSource(f, bad_rows="error")
  with pytest.raises(ValueError, match=r"no usable 'train' rows.*2 bad.*g\.jsonl:2: not valid JSON"):
    PromptSource(f)
