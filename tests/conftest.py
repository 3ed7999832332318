"""Test setup: 8 fake CPU devices for mesh tests, CPU-only JAX unless told otherwise, fp32 matmuls at
full precision, tests that need more devices (or a GPU) than present skipped with the reason, shared
tiny-model fixtures."""

import os

from llamarl_jax import compat  # noqa: E402  (no jax import: the flags are set before JAX starts)

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # `make test-gpu` sets JAX_PLATFORMS=cuda
compat.ensure_cpu_devices(8)  # unless XLA_FLAGS sets a count (`make test`: the same 8)
# fp32 parity tests (logits vs transformers, cached decode vs full forward, sharded vs one device) hold
# fp32 to ~1e-6-relative tolerances. A GPU's default precision multiplies fp32 matrices in TF32 (10
# mantissa bits, ~5e-4 relative per product), which those bounds do not allow; "highest" makes fp32
# mean fp32 on every backend, so the same tolerances hold on CPU and GPU. CPU ignores the setting (its
# results are bit-identical either way); bf16 matmuls are unaffected. An environment variable, so the
# executor threads and the interpreters the multi-process tests start get it too.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

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


DEVICES_HINT = ("`make test` fakes 8 CPU devices: JAX_PLATFORMS=cpu "
                "python -m llamarl_jax.compat --cpu_devices 8 -- python -m pytest ...")


_CPU_LOG = os.environ.get("LLAMARL_TEST_CPU_LOG")  # a file: each test's CPU seconds, appended per test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """With LLAMARL_TEST_CPU_LOG set, append `cpu_seconds node_id` per test: this process's and its
  finished children's user + system time over setup, call and teardown. Unlike `--durations` (wall
  time), it changes little with the machine's load, so the suite's cost can be measured on a busy
  machine (`make test-cost`)."""
  if not _CPU_LOG:
    yield
    return
  import resource

  def cpu():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

  start = cpu()
  yield
  with open(_CPU_LOG, "a") as f:
    f.write(f"{cpu() - start:.2f} {item.nodeid}\n")


def pytest_collection_modifyitems(config, items):
  """`@pytest.mark.devices(n)`: skip with fewer than n JAX devices; `@pytest.mark.gpu`: skip without a GPU.

  Each skip says what was needed and what is present, so a one-device run reports which cases it could
  not run instead of failing in mesh construction (or passing by checking less)."""
  import jax

  available = jax.devices()
  on_gpu = jax.default_backend() == "gpu"
  for item in items:
    if item.get_closest_marker("gpu") is not None and not on_gpu:
      item.add_marker(pytest.mark.skip(reason=(
          f"needs a GPU; JAX's backend is {jax.default_backend()!r} (on a GPU machine: "
          "pip install -e '.[cuda12]' and `make test-gpu`)")))
    mark = item.get_closest_marker("devices")
    if mark is not None and mark.args[0] > len(available):
      item.add_marker(pytest.mark.skip(reason=(
          f"needs {mark.args[0]} devices for its mesh, {len(available)} available "
          f"({available[0].platform}); {DEVICES_HINT}")))


def mesh_at_most(*, data=1, fsdp=1, tp=1):
  """`parallel.make_mesh` with these axes, shrunk to the devices present: axes are halved (tp, then
  fsdp, then data) until the mesh fits. For fixtures whose tests check a result, not a layout; tests
  that check sharding itself ask for their devices with `@pytest.mark.devices(n)`."""
  import jax

  from llamarl_jax import parallel

  axes = {"data": data, "fsdp": fsdp, "tp": tp}
  for name in ("tp", "fsdp", "data"):
    while axes["data"] * axes["fsdp"] * axes["tp"] > len(jax.devices()) and axes[name] > 1:
      axes[name] //= 2
  n = axes["data"] * axes["fsdp"] * axes["tp"]
  return parallel.make_mesh(jax.devices()[:n], **axes)


HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
# a tiny Qwen3-MoE: 4 experts of width 16, 2 per token, the experts in every layer unless overridden
MOE_DEFAULTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
                    mlp_only_layers=[], norm_topk_prob=False)


def tiny_hf_config(family="llama", **overrides):
  """A tiny transformers config of `family` (GQA, 2 layers) with overrides."""
  import transformers

  kw = dict(vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
  if family in ("qwen3", "qwen3_moe"):
    kw["head_dim"] = 8  # Qwen3 states head_dim; = hidden / heads unless overridden
  if family == "qwen3_moe":
    kw.update(MOE_DEFAULTS)
  kw.update(overrides)
  return getattr(transformers, HF_CLASSES[family][0])(**kw)


def tiny_hf_model(family="llama", seed=0, **overrides):
  """A random transformers causal LM of `family`, fp32, eval mode.

  transformers initialises biases to 0 and norm scales to 1, which would hide a missing or misplaced
  bias or norm; here they are random too (biases ~ N(0, 0.1), norm scales ~ 1 + N(0, 0.1)). A MoE
  router's weights are N(0, 1 / hidden) (transformers' N(0, 0.02) routes nearly uniformly, which
  would hide a wrong routing weight).
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
      elif name.endswith("mlp.gate.weight"):
        p.normal_(0.0, p.shape[1] ** -0.5)
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
