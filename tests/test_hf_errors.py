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


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "mistral", "model_type 'mistral'"),
    ("attention_bias", True, "attention_bias"),
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling.rope_type='yarn'"),
])
def test_unsupported_config_field(make_hf_model, field, value, match):
  _, path = make_hf_model()
  _edit_config(path, **{field: value})
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
