"""The char-level tokenizer: tiny vocab, exact round trips, special tokens, save/load."""

import string

from transformers import AutoTokenizer

from llamarl_jax.tokenizer import make_char_tokenizer

TEXT = "Q: 23+58=?\nA: 81. (x_1 ~ [a-z]) {\\boxed{42}} 'ok' \"fine\" #$%&*;<>@^`|"


def test_vocab_and_special_ids():
  tok = make_char_tokenizer()
  assert len(tok) == 4 + 10 + 52 + 32 + 2 == 100
  assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
  assert tok.chat_template is None


def test_one_token_per_character_and_exact_decode():
  tok = make_char_tokenizer()
  ids = tok(TEXT, add_special_tokens=False)["input_ids"]
  assert len(ids) == len(TEXT)
  assert tok.decode(ids) == TEXT
  assert all(tok.decode([i]) == c for i, c in zip(ids, TEXT))


def test_bos_is_added_by_default_and_special_tokens_skip_on_decode():
  tok = make_char_tokenizer()
  ids = tok("12+3=")["input_ids"]
  assert ids[0] == tok.bos_token_id and len(ids) == 6
  assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == "12+3="
  assert make_char_tokenizer(add_bos=False)("12")["input_ids"] == ids[1:3]


def test_unknown_characters_and_extra_chars():
  tok = make_char_tokenizer()
  assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
  tok2 = make_char_tokenizer("é×" + string.digits)  # duplicates of the base set are ignored
  assert len(tok2) == 102
  assert tok2.decode(tok2("3×é", add_special_tokens=False)["input_ids"]) == "3×é"


def test_save_pretrained_round_trip(tmp_path):
  tok = make_char_tokenizer("é")
  tok.save_pretrained(tmp_path)
  loaded = AutoTokenizer.from_pretrained(tmp_path)
  assert len(loaded) == len(tok)
  assert loaded(TEXT + "é")["input_ids"] == tok(TEXT + "é")["input_ids"]
  assert loaded.decode(tok(TEXT)["input_ids"], skip_special_tokens=True) == TEXT
  assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def test_batch_padding():
  tok = make_char_tokenizer()
  batch = tok(["1+1=", "10+10="], padding=True, add_special_tokens=False)
  assert batch["input_ids"][0][-2:] == [tok.pad_token_id] * 2  # right padding by default
  assert batch["attention_mask"][0] == [1, 1, 1, 1, 0, 0]
