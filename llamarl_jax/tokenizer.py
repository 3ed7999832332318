"""A character-level tokenizer for the tiny embedded models, built locally (no hub access).

One token per character: digits, ASCII letters, ASCII punctuation, space and newline (plus
`extra_chars`), after the special tokens <pad>=0, <bos>=1, <eos>=2, <unk>=3: 100 tokens by default.
It is a regular `transformers.PreTrainedTokenizerFast`, so `save_pretrained` writes tokenizer.json and
`AutoTokenizer.from_pretrained` loads it back, e.g. next to an exported HF checkpoint.
"""

from __future__ import annotations

import string

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
BASE_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def make_char_tokenizer(extra_chars: str = "", *, add_bos: bool = True, model_max_length: int = 4096):
  """A `PreTrainedTokenizerFast` with one token per character.

  add_bos: `tokenizer(text)` prepends <bos> (as Llama tokenizers do); `add_special_tokens=False` skips it.
  Characters outside the vocabulary encode to <unk>. Decoding concatenates characters exactly.
  """
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
  from transformers import PreTrainedTokenizerFast

  chars = list(dict.fromkeys(BASE_CHARS + extra_chars))  # ordered, deduplicated
  vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + chars)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char alone
  tok.decoder = decoders.Fuse()  # join without separators
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  if add_bos:
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                 unk_token="<unk>", clean_up_tokenization_spaces=False,
                                 model_max_length=model_max_length)
