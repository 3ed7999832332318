"""`llamarl_jax.compat` on the running JAX: every private entry point the package uses resolves and
behaves as the package calls it, the XLA flags chosen are ones this XLA starts with, and where Pallas'
Triton backend is missing the slot engine takes XLA's paged attention with one warning line. CI runs
this file on each supported stack (jax 0.10.2 on Python 3.11, jax 0.12 on Python 3.12; 0.11.2, the GPU
machines', passed it on the CPU too), so a JAX release that moves one of these fails here, by name."""

import inspect
import subprocess
import sys
from importlib.metadata import version

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import compat

JAX = tuple(int(p) for p in version("jax").split(".")[:2])


def test_supported_jax():
  assert (0, 10) <= JAX <= (0, 12), f"jax {version('jax')} is outside the tested range (pyproject.toml)"


def test_the_flag_table_is_this_xlas():
  """Flags every supported XLA defines are found, a made-up one is not; the fusion emitters' switch
  exists in jax 0.10.2 and is gone from 0.11.2 on (where naming it aborts XLA)."""
  assert compat.xla_accepts(compat.DEVICE_COUNT)
  assert compat.xla_accepts(f"--{compat.LLVM_OPT}=1")
  assert compat.xla_accepts("xla_dump_to")
  assert not compat.xla_accepts("xla_cpu_no_such_flag_anywhere")
  assert compat.xla_accepts(compat.FUSION_EMITTERS) == (JAX < (0, 11))


def test_chosen_flags_start_xla_with_the_devices_asked_for():
  """The test profile's flags, as `make test` sets them, in a fresh interpreter: XLA starts (an unknown
  flag would abort it) and fakes the devices asked for."""
  env = compat.xla_env(cpu_devices=3, compile="fast")
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices()))"], env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-1] == "3"
  flags = env["XLA_FLAGS"].split()
  assert f"--{compat.DEVICE_COUNT}=3" in flags and f"--{compat.LLVM_OPT}=1" in flags
  assert (f"--{compat.FUSION_EMITTERS}=false" in flags) == compat.xla_accepts(compat.FUSION_EMITTERS)


def test_the_launcher_runs_a_command_with_the_flags():
  out = subprocess.run([sys.executable, "-m", "llamarl_jax.compat", "--cpu_devices", "2", "--",
                        sys.executable, "-c", "import os; print(os.environ['XLA_FLAGS'])"],
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  assert f"--{compat.DEVICE_COUNT}=2" in out.stdout.split()


def test_a_flag_this_xla_lacks_is_dropped_with_one_line(capsys):
  merged = compat.merge_flags(f"--xla_no_such_flag=1 --xla_dump_to=/tmp/x --{compat.DEVICE_COUNT}=8",
                              compat.cpu_flags(cpu_devices=2))
  assert merged.split()[0] == "--xla_dump_to=/tmp/x"
  assert f"--{compat.DEVICE_COUNT}=2" in merged and f"{compat.DEVICE_COUNT}=8" not in merged  # ours replace theirs
  assert "xla_no_such_flag" not in merged
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "dropped --xla_no_such_flag=1" in err[0]


def test_fusion_emitters_on_off_where_the_switch_exists():
  if compat.xla_accepts(compat.FUSION_EMITTERS):
    assert f"--{compat.FUSION_EMITTERS}=true" in compat.cpu_flags(fusion_emitters="on")
    assert f"--{compat.FUSION_EMITTERS}=false" in compat.cpu_flags(fusion_emitters="off")
    assert f"--{compat.FUSION_EMITTERS}=false" in compat.cpu_flags()  # 'auto': the faster-compiling emitters
  else:
    assert compat.cpu_flags(fusion_emitters="on") == compat.cpu_flags() == []
    with pytest.raises(ValueError, match="always uses the fusion emitters"):
      compat.cpu_flags(fusion_emitters="off")
  with pytest.raises(ValueError, match="compile must be one of"):
    compat.cpu_flags(compile="quick")
  with pytest.raises(ValueError, match="llvm_opt must be in 0..3"):
    compat.cpu_flags(llvm_opt=5)


def test_jit_cache_size_counts_compiled_programs():
  f = jax.jit(lambda x: x * 2)
  assert compat.jit_cache_size(f) == 0
  f(jnp.ones(3))
  f(jnp.ones(3))
  f(jnp.ones(4))
  assert compat.jit_cache_size(f) == 2


def test_cudnn_entry_point_takes_the_arguments_passed_to_it():
  """`model.attention.segment_attention` passes (q, k, v, bias, mask, q_seqlen, kv_seqlen, q_offsets,
  kv_offsets) positionally, then scale and mask_type: the entry point's parameters must be those."""
  attention, mask_type = compat.cudnn_dot_product_attention()
  params = list(inspect.signature(attention).parameters)
  assert params[:9] == ["query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"]
  assert "scale" in params and "mask_type" in params
  assert mask_type.CAUSAL is not None


def test_cudnn_compute_capability_target_is_restored():
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  before = cudnn.check_compute_capability
  with compat.cudnn_target_compute_capability("9.0"):
    assert cudnn.check_compute_capability("8.0") and not cudnn.check_compute_capability("10.0")
    assert cudnn.is_cuda_compute_capability_equal("9.0")
  assert cudnn.check_compute_capability is before


def test_coordination_client_without_jax_distributed_says_so():
  with pytest.raises(RuntimeError, match="jax.distributed is not initialized"):
    compat.coordination_client()


def test_hlo_cost_analysis_counts_a_matmuls_flops():
  compiled = jax.jit(lambda a, b: a @ b).lower(jnp.ones((8, 16)), jnp.ones((16, 32))).compile()
  cost = compat.hlo_cost_analysis(compiled)
  assert cost["flops"] == 2 * 8 * 16 * 32


def test_pallas_triton_present_on_the_supported_versions():
  """Deprecated since jax 0.11, still importable in 0.12: present on every supported version."""
  assert compat.pallas_triton_missing() is None
  assert compat.pallas_triton_compiler_params(num_warps=4, num_stages=2) is not None


@pytest.fixture
def triton_missing(monkeypatch):
  """Pallas' Triton backend made to fail to import (a JAX that removed it)."""
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  compat.pallas_triton_missing.cache_clear()
  yield
  compat.pallas_triton_missing.cache_clear()


def test_without_triton_the_engine_takes_xlas_paged_attention_with_one_warning(triton_missing, capsys):
  """A JAX without Pallas' Triton backend: 'auto' on one GPU keeps XLA's form (so the fp8 fused decode,
  which needs the kernel, is off too) and says why in one line; asking for the kernel is an error; the
  kernels' compiler parameters name the reason. The XLA form the engine then runs ('reduce' on a GPU)
  equals a float64 reference over the same blocks."""
  from llamarl_jax.generation.program_set import decode_attention_choice
  from llamarl_jax.model.paged_attention import (paged_decode_attention, resolve_paged_implementation,
                                                 target_platform)

  assert compat.pallas_triton_missing().startswith("ModuleNotFoundError")
  choice = decode_attention_choice("auto", "gpu", 1)
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "XLA's paged attention instead of the Pallas kernel" in err[0] and "ModuleNotFoundError" in err[0]
  with target_platform("gpu", choice):
    form = resolve_paged_implementation("auto")
  assert form == "reduce"
  with pytest.raises(ValueError, match="needs Pallas' Triton backend"):
    decode_attention_choice("pallas", "gpu", 1)
  with pytest.raises(RuntimeError, match="Triton backend is not available"):
    compat.pallas_triton_compiler_params(num_warps=4)
  assert decode_attention_choice("auto", "cpu", 1) == "auto"  # the CPU never needed it: no warning
  assert capsys.readouterr().err == ""

  rng = np.random.RandomState(0)
  NB, BS, KV, H, D = 6, 4, 2, 4, 8
  k_pool, v_pool = rng.randn(2, NB, BS, KV, D).astype(np.float32)
  q = rng.randn(2, 1, H, D).astype(np.float32)
  rows = {0: [(1, 4), (3, 2)], 1: [(4, 3)]}
  row, block, length = (jnp.array(c, jnp.int32) for c in zip(*[(r, b, n) for r in rows for b, n in rows[r]]))
  got = np.asarray(paged_decode_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), row, block,
                                          length, form))[:, 0]
  for b, blocks in rows.items():
    k = np.concatenate([k_pool[i, :n] for i, n in blocks]).astype(np.float64)
    v = np.concatenate([v_pool[i, :n] for i, n in blocks]).astype(np.float64)
    for h in range(H):
      s = k[:, h // (H // KV)] @ q[b, 0, h] / np.sqrt(D)
      p = np.exp(s - s.max())
      # fp32 scores, softmax and sums over <= 6 positions of O(1) values: ~1e-6 relative; 1e-5 catches a
      # wrong block, length or head (errors of O(0.1))
      np.testing.assert_allclose(got[b, h], p / p.sum() @ v[:, h // (H // KV)], rtol=1e-5, atol=1e-5)


def test_with_triton_one_gpu_runs_the_kernel_and_meshes_keep_xla():
  from llamarl_jax import gpu_paths
  from llamarl_jax.generation.program_set import GPU_KERNEL_PREFERENCE, decode_attention_choice
  chosen = decode_attention_choice("auto", "gpu", 1)  # the preferred kernel form that has passed on a GPU
  assert chosen == next(f for f in GPU_KERNEL_PREFERENCE if gpu_paths.passed("paged_attention", f))
  assert decode_attention_choice("pallas_fused", "gpu", 1) == "pallas_fused"  # opt-in by name
  assert decode_attention_choice("auto", "gpu", 2) == "auto"
  assert decode_attention_choice("reduce", "gpu", 1) == "reduce"


def test_gin_parsed_bindings_lists_scoped_bindings_with_their_configurable():
  import gin

  @gin.configurable("compat_probe")
  def probe(a=1, b=2):
    return a + b

  with gin.unlock_config():
    gin.parse_config(["compat_probe.a = 5", "eval/compat_probe.b = 7"])
  try:
    got = {(scope, c.name): (dict(params), c.wrapped.__qualname__)
           for scope, _, params, c in compat.gin_parsed_bindings() if c is not None}
    assert got[("", "compat_probe")] == ({"a": 5}, probe.__qualname__)
    assert got[("eval", "compat_probe")] == ({"b": 7}, probe.__qualname__)
  finally:
    gin.clear_config()
