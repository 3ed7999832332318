"""Test setup: 8 fake CPU devices for mesh tests, CPU-only JAX, shared tiny-model fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402


def tiny_hf_config(**overrides):
  """A tiny transformers LlamaConfig (GQA, 2 layers) with overrides."""
  import transformers

  kw = dict(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
  kw.update(overrides)
  return transformers.LlamaConfig(**kw)


@pytest.fixture
def make_hf_model(tmp_path):
  """Build a random `transformers.LlamaForCausalLM`, save it, return (torch_model, directory)."""
  import torch
  import transformers

  def make(name="ref", seed=0, **overrides):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_hf_config(**overrides)).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return model, path

  return make
