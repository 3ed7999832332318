"""Test setup: 8 fake CPU devices for mesh tests, CPU-only JAX, shared tiny-model fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

# A persistent compilation cache shared by every test of this session (and by the interpreters the
# multi-process tests start, which inherit the environment): many tests jit new closures whose XLA
# programs are identical to an earlier test's, and compiling is most of the suite's time on CPU
# (tests/test_controller.py + test_trainer.py: 8.6 min without, 3.8 min with, from an empty cache).
# The cache is keyed by the program, options and backend, so a hit is the same executable; it starts
# empty in each session's own directory and is removed at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _cache_dir = tempfile.mkdtemp(prefix="llamarl_test_jax_cache_")
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import pytest  # noqa: E402


HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def tiny_hf_config(family="llama", **overrides):
  """A tiny transformers config of `family` (GQA, 2 layers) with overrides."""
  import transformers

  kw = dict(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
  if family == "qwen3":
    kw["head_dim"] = 8  # Qwen3 states head_dim; = hidden / heads unless overridden
  kw.update(overrides)
  return getattr(transformers, HF_CLASSES[family][0])(**kw)


def tiny_hf_model(family="llama", seed=0, **overrides):
  """A random transformers causal LM of `family`, fp32, eval mode.

  transformers initialises biases to 0 and norm scales to 1, which would hide a missing or misplaced
  bias or norm; here they are random too (biases ~ N(0, 0.1), norm scales ~ 1 + N(0, 0.1)).
  """
  import torch
  import transformers

  torch.manual_seed(seed)
  model = getattr(transformers, HF_CLASSES[family][1])(tiny_hf_config(family, **overrides)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("bias"):
        p.normal_(0.0, 0.1)
      elif "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  return model


@pytest.fixture
def make_hf_model(tmp_path):
  """Build a random transformers model of a family (default Llama), save it, return (torch_model, directory)."""

  def make(name="ref", seed=0, family="llama", **overrides):
    model = tiny_hf_model(family, seed, **overrides)
    path = tmp_path / name
    model.save_pretrained(path)
    return model, path

  return make


CHATML_TEMPLATE = (  # Qwen's chat format (as Qwen3's template without tools / thinking): no BOS, ChatML turns
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")


def chatml_tokenizer():
  """A Qwen-style tokenizer built locally: the char vocabulary (no BOS) plus <|endoftext|> (pad),
  <|im_start|> and <|im_end|> (eos, ends an assistant turn), and a ChatML chat template."""
  from llamarl_jax.tokenizer import make_char_tokenizer

  tok = make_char_tokenizer(add_bos=False)
  tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]})
  tok.eos_token, tok.pad_token, tok.chat_template = "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE
  tok.bos_token = None  # Qwen tokenizers have none
  return tok
