"""WeightSync: trainer params (FSDP mesh) -> generator layout (TP mesh on other devices), exact in fp32,
bounded error in bf16, fp8 as quantised on the trainer, with version / wait / close semantics for the executors' threads."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import parallel
from llamarl_jax.executors.weight_sync import WeightSync, tree_bytes
from llamarl_jax.model import fp8
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.model.llama import abstract_model, split_params

# vocab, hidden and mlp split 4 ways; the 2 kv heads do not, so wk / wv stay replicated over tp.
CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     max_position_embeddings=32)


# the `setup` meshes: trainer fsdp=4 beside generator tp=4 (tests that need fewer say so)
pytestmark = pytest.mark.devices(8)


@pytest.fixture(scope="module")
def setup():
  """(trainer params on an fsdp=4 mesh, generator shardings on a disjoint tp=4 mesh, the two meshes)."""
  trainer_mesh, gen_mesh = parallel.make_meshes(trainer_fsdp=4, generator_tp=4)
  abstract = abstract_model(CONFIG)
  _, shapes = split_params(abstract)
  axes = parallel.logical_axes(abstract)
  rng = np.random.default_rng(0)
  host = jax.tree.map(lambda s: rng.standard_normal(s.shape, dtype=np.float32), shapes)
  params = jax.device_put(host, parallel.param_shardings(shapes, axes, trainer_mesh))
  return params, parallel.param_shardings(shapes, axes, gen_mesh), trainer_mesh, gen_mesh


def _pairs(a, b):
  return zip(jax.tree.leaves(a), jax.tree.leaves(b))


def test_fp32_push_gives_the_generator_exactly_the_trainer_params(setup):
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.float32)
  sync.push(params, version=1)
  gen_params, version = sync.latest()
  assert version == 1
  assert jax.tree.structure(gen_params) == jax.tree.structure(params)
  for t, g in _pairs(params, gen_params):
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.asarray(t))


@pytest.mark.parametrize("dtype,quantize", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, "fp8")])
def test_generator_arrays_live_on_generator_devices_only(setup, dtype, quantize):
  params, gen_shardings, trainer_mesh, gen_mesh = setup
  sync = WeightSync(gen_shardings, dtype=dtype, quantize=quantize)
  sync.push(params, version=0)
  gen_params, _ = sync.latest()
  gen_devices, trainer_devices = set(gen_mesh.devices.flat), set(trainer_mesh.devices.flat)
  assert not gen_devices & trainer_devices
  for g, s in zip(jax.tree.leaves(gen_params), jax.tree.leaves(sync.out_shardings, is_leaf=lambda x: isinstance(
      x, jax.sharding.Sharding))):
    assert g.devices() == gen_devices  # every generator device holds a shard or replica, no trainer device
    assert g.sharding.is_equivalent_to(s, g.ndim)
    assert g.dtype in ((dtype,) if quantize is None else (dtype, fp8.FP8, jnp.float32))


def test_bf16_cast_error_within_unit_roundoff(setup):
  """Round to nearest bf16 (8 significant bits): |x - bf16(x)| <= 2^-8 |x|, elementwise."""
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.bfloat16)
  sync.push(params, version=0)
  for t, g in _pairs(params, sync.latest()[0]):
    t, g = np.asarray(t), np.asarray(g, dtype=np.float32)
    assert np.all(np.abs(g - t) <= 2.0**-8 * np.abs(t))


def test_fp8_push_moves_what_the_generator_computes_with(setup):
  """The trainer quantises (`fp8.quantize_params`), the fp8 values and scales cross and are held as
  they are: the projections exactly as quantised on one device, at half of bf16's bytes (+ 4 bytes
  of scale per output channel); the other leaves in bf16."""
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.bfloat16, quantize="fp8")
  metrics = sync.push(params, version=0)
  got = sync.latest()[0]
  host = jax.tree.map(np.asarray, params)
  expected = fp8.quantize_params(jax.tree.map(jnp.asarray, host), jnp.bfloat16)
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    assert g.dtype == e.dtype
    np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(e.astype(jnp.float32)))
  layer = got["layers"][0]
  assert layer["attn"]["wq"].dtype == fp8.FP8 and layer["attn"]["wq_scale"].shape == (4, 8)
  assert layer["attn"]["wo_scale"].shape == (32,) and got["embed"].dtype == jnp.bfloat16
  bf16 = tree_bytes(params) / 2
  scales = sum(x.nbytes for i in got["layers"] for m in ("attn", "mlp") for k, x in got["layers"][i][m].items()
               if k.endswith("_scale"))
  projections = sum(host["layers"][i][m][k].size for i in host["layers"] for m in ("attn", "mlp")
                    for k in fp8.INPUT_AXES[m] if k in host["layers"][i][m])
  assert metrics["sync/bytes"] == bf16 - projections + scales  # 2 -> 1 byte per projection weight


def test_push_reports_seconds_bytes_and_throughput(setup):
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.bfloat16)
  metrics = sync.push(params, version=7)
  assert metrics["sync/bytes"] == tree_bytes(params) / 2  # fp32 -> bf16 halves the bytes that move
  assert metrics["sync/seconds"] > 0 and metrics["sync/version"] == 7
  assert metrics["sync/gbps"] == pytest.approx(metrics["sync/bytes"] / metrics["sync/seconds"] / 1e9)
  assert sync.history == [metrics]


def test_rejects_unknown_quantization(setup):
  with pytest.raises(ValueError, match=r"WeightLayout.quantize .*expected None, 'fp8' or 'fp8\+lm_head'"):
    WeightSync(setup[1], quantize="int8")


def _waiter(sync, version, timeout=None):
  """Start a thread blocked in wait_for_version; returns (thread, result list)."""
  out = []
  thread = threading.Thread(target=lambda: out.append(sync.wait_for_version(version, timeout)), daemon=True)
  thread.start()
  return thread, out


def test_versions_and_waiting(setup):
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.bfloat16)
  assert sync.version == -1 and sync.latest() == (None, -1)
  assert sync.wait_for_version(0, timeout=0.01) is False  # nothing pushed yet: times out
  thread, out = _waiter(sync, 2)
  sync.push(params, version=1)
  thread.join(0.2)
  assert thread.is_alive() and not out  # version 1 < 2: still waiting
  sync.push(params, version=2)
  thread.join(5)
  assert out == [True] and sync.version == 2
  assert sync.wait_for_version(1, timeout=0) is True  # already past: returns at once


def test_close_wakes_waiters_and_reopen_restores_blocking(setup):
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.bfloat16)
  sync.push(params, version=0)
  thread, out = _waiter(sync, 10)
  thread.join(0.1)
  assert thread.is_alive()
  sync.close()
  thread.join(5)
  assert out == [False]  # woken, version 10 never arrived
  late, late_out = _waiter(sync, 10)  # after close a waiter returns at once, even without a timeout
  late.join(5)
  assert late_out == [False]
  sync.reopen()
  assert sync.wait_for_version(10, timeout=0.05) is False  # blocks again (until the timeout)
  assert sync.latest()[1] == 0  # the weights survive close / reopen


def test_take_returns_the_exact_version_and_drops_older_ones(setup):
  """The 'fixed' schedule asks for exact versions in increasing order; pending ones wait for it."""
  params, gen_shardings, _, _ = setup
  sync = WeightSync(gen_shardings, dtype=jnp.bfloat16, keep_pending=True)
  for v in (0, 1, 2):  # the trainer ran ahead: three versions pending
    sync.push(jax.tree.map(lambda x, v=v: x + v, params), version=v)
  got, version = sync.take(1, timeout=1)
  assert version == 1
  for t, g in _pairs(jax.tree.map(lambda x: x + 1, params), got):  # version 1's weights, not the newest
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(t, jnp.bfloat16).astype(np.float32))
  assert sync.take(3, timeout=0.01) is None  # not pushed yet: times out
  with pytest.raises(ValueError, match=r"version 0 was asked for but is no longer held \(held: \[1, 2\]\)"):
    sync.take(0, timeout=0)  # 0 is dropped (never asked for again); 1 and 2 stay
  latest_only = WeightSync(gen_shardings, dtype=jnp.bfloat16)  # the 'latest' schedule keeps one copy
  latest_only.push(params, version=0)
  latest_only.push(params, version=1)
  with pytest.raises(ValueError, match=r"no longer held \(held: \[1\]\)"):
    latest_only.take(0, timeout=0)
