"""Bad checkpoints fail with an error that names the file or field at fault."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from llamarl_jax.model import ModelConfig, load_hf_checkpoint, load_tokenizer
from llamarl_jax.model.hf import CheckpointError, check_tokenizer_matches


def _edit_config(path, **changes):
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(changes)
  (path / "config.json").write_text(json.dumps(cfg))


def test_missing_directory(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    load_hf_checkpoint(tmp_path / "nope")


def test_missing_config(make_hf_model):
  _, path = make_hf_model()
  (path / "config.json").unlink()
  with pytest.raises(CheckpointError, match="config.json is missing"):
    load_hf_checkpoint(path)


def test_missing_weights_file(make_hf_model):
  _, path = make_hf_model()
  (path / "model.safetensors").unlink()
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    load_hf_checkpoint(path)


SUPPORTED = r"supported: 'llama' \(LlamaForCausalLM\), 'qwen2' \(Qwen2ForCausalLM\), 'qwen3' \(Qwen3ForCausalLM\)"


@pytest.mark.parametrize("family,changes,match", [
    ("llama", {"model_type": "mistral"}, "model_type 'mistral' is not supported; " + SUPPORTED),
    ("qwen2", {"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not supported; " + SUPPORTED),
    ("llama", {"model_type": "mixtral"}, "model_type 'mixtral' is not supported; " + SUPPORTED),
    ("qwen2", {"architectures": ["LlamaForCausalLM"]}, r"need Qwen2ForCausalLM"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True is not supported for model_type 'qwen3'"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_scaling.rope_type='dynamic' is not supported \(supported: 'default', 'llama3', 'yarn'\)"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn"}}, r"rope_scaling \(yarn\) is missing \['factor'\]"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     "sliding-window attention .*use_sliding_window=True, sliding_window=16, layers >= max_window_layers=1"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, r"sliding-window attention .*layers \[1\]"),
])
def test_unsupported_config_field(make_hf_model, family, changes, match):
  _, path = make_hf_model(family=family)
  _edit_config(path, **changes)
  with pytest.raises(CheckpointError, match=match):
    load_hf_checkpoint(path)


def test_missing_tensor(make_hf_model):
  _, path = make_hf_model()
  tensors = load_file(path / "model.safetensors")
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
    load_hf_checkpoint(path)


def test_misshaped_tensor(make_hf_model):
  _, path = make_hf_model()
  tensors = load_file(path / "model.safetensors")
  tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
  save_file(tensors, path / "model.safetensors")
  with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_proj.weight has shape"):
    load_hf_checkpoint(path)


def test_config_weights_mismatch(make_hf_model):
  _, path = make_hf_model()
  _edit_config(path, num_hidden_layers=1)
  with pytest.raises(CheckpointError, match="unexpected tensors.*model.layers.1"):
    load_hf_checkpoint(path)


def test_missing_tokenizer(tmp_path):
  tmp_path.joinpath("empty").mkdir()
  with pytest.raises(CheckpointError, match="no tokenizer.json"):
    load_tokenizer(tmp_path / "empty")


def test_tokenizer_model_mismatch():
  class FakeTok:
    def __len__(self):
      return 200
  with pytest.raises(CheckpointError, match="tokenizer has 200 tokens but the model's vocab_size is 67"):
    check_tokenizer_matches(FakeTok(), ModelConfig(vocab_size=67, hidden_size=32, intermediate_size=64,
                                                    num_layers=1, num_heads=4, num_kv_heads=2))
