"""Expert parallelism by token dispatch (`moe.grouped_swiglu(..., expert_parallel='dispatch')`) against
the unsharded grouped matmuls (mesh=None), and `choose_expert_parallel`'s pick.

On the CPU, 'dispatch' runs its dense form ('dispatch_dense': XLA:CPU has no ragged all-to-all), which
shares every index computation with the ragged one and differs only in the exchange primitive;
`test_dense_all_to_all_gives_ragged_all_to_alls_result` checks that primitive against
`jax.lax.ragged_all_to_all`'s documented example, and tests/cuda_compile/test_h100_moe.py compiles
the ragged form for an H100.

Tolerance: fp32 on both sides; each output and gradient element is the same products summed in
another order (the k choices of a token, a ragged matmul's rows over another grouping, the all-to-all
moving rows without arithmetic), so they agree to fp32 rounding of those sums: rtol 1e-5, and for
elements near zero an absolute floor of N fp32 ulps of the largest entry (a weight's gradient sums
up to N = 64 tokens' terms, each sum's rounding at most an ulp of its largest partial sum; which CPU
kernel sums them, and in which order, differs between machines).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax import parallel
from llamarl_jax.model import moe

N, E, F, X, K = 64, 16, 24, 8, 2  # tokens, embed, expert width, experts, top-k
RTOL, ATOL = 1e-5, 1e-6


def problem(seed=0):
  rng = np.random.RandomState(seed)
  f32 = lambda *s, scale=1.0: jnp.asarray(rng.randn(*s) * scale, jnp.float32)
  return {"x": f32(N, E), "router": f32(E, X, scale=0.5), "w_gate": f32(X, E, F, scale=E ** -0.5),
          "w_up": f32(X, E, F, scale=E ** -0.5), "w_down": f32(X, F, E, scale=F ** -0.5), "ct": f32(N, E)}


def replay_rows(kind, seed=0):
  """replay `[N, K]` for a routing case: 'own' none (each token's own top-k); 'replay' half the tokens
  replay fixed experts, the rest (rows of -1) keep their own; 'one_owner' every token replays two of
  the first device's experts at EP=4 (X/4 = 2 = K: every row goes to one device, the others' experts
  are empty, and that device receives the most rows it can)."""
  rng = np.random.RandomState(seed + 1)
  if kind == "own":
    return None
  if kind == "one_owner":
    return jnp.asarray(np.tile([[1, 0]], (N, 1)), jnp.int32)
  rows = np.stack([rng.choice(X, K, replace=False) for _ in range(N)]).astype(np.int32)
  rows[rng.rand(N) < 0.5] = -1
  return jnp.asarray(rows)


def layer_loss(params, replay, mesh, way, fused=False):
  """sum(ct * MoE(x)): the router's weights and experts (`moe.route`, replay as given) and the
  grouped matmuls over `mesh` the `way` given."""
  weights, experts, _, _ = moe.route(params["x"], params["router"], K, True, replay)
  gate_up = (jnp.stack([params["w_gate"], params["w_up"]], axis=2) if fused
             else (params["w_gate"], params["w_up"]))
  out = moe.grouped_swiglu(params["x"], experts, weights, gate_up, params["w_down"], mesh, expert_parallel=way)
  return jnp.sum(out * params["ct"]), out


def value_and_grads(params, replay, mesh, way, fused=False):
  fn = jax.jit(jax.value_and_grad(lambda p: layer_loss(p, replay, mesh, way, fused), has_aux=True))
  (_, out), grads = fn(params)
  grads.pop("ct")
  return out, grads


_REFERENCE = {}


def reference(kind, fused=False):
  """The unsharded result and gradients (mesh=None: `_local_swiglu` over all experts)."""
  if (kind, fused) not in _REFERENCE:
    _REFERENCE[kind, fused] = value_and_grads(problem(), replay_rows(kind), None, None, fused)
  return _REFERENCE[kind, fused]


def assert_same(got, want):
  (out, grads), (want_out, want_grads) = got, want
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=RTOL, atol=ATOL, err_msg="output")
  for name in want_grads:
    floor = max(ATOL, N * np.finfo(np.float32).eps * float(np.abs(np.asarray(want_grads[name])).max()))
    np.testing.assert_allclose(np.asarray(grads[name]), np.asarray(want_grads[name]), rtol=RTOL, atol=floor,
                               err_msg=f"d loss / d {name}")
    assert np.abs(np.asarray(want_grads[name])).max() > 1e-3, name  # a gradient that is there


@pytest.mark.devices(8)
@pytest.mark.parametrize("shape,kind", [
    ({"expert": 2, "fsdp": 2, "tp": 2}, "replay"),
    ({"expert": 4, "fsdp": 2}, "replay"),
    ({"expert": 4, "fsdp": 2}, "one_owner"),
    ({"expert": 2, "data": 2, "fsdp": 2}, "own"),
    ({"expert": 8}, "replay"),
])
def test_dispatch_equals_the_unsharded_layer(shape, kind):
  """Output and gradients (x, router, experts' weights) of dispatch over `shape` equal mesh=None's:
  replayed and own routing, a device whose experts receive every row while the others' are empty
  (the dropless worst case), batch axes (data, fsdp) and an automatic tp axis beside `expert`."""
  mesh = parallel.make_mesh(jax.devices()[:int(np.prod(list(shape.values())))], **shape)
  assert_same(value_and_grads(problem(), replay_rows(kind), mesh, "dispatch"), reference(kind))


@pytest.mark.devices(8)
def test_dispatch_of_the_fused_gate_up_layout():
  """The serving layout's fused w_gate_up `[X, E, 2, F]` dispatches like the pair (expert=4, fsdp=2)."""
  mesh = parallel.make_mesh(jax.devices()[:8], expert=4, fsdp=2)
  assert_same(value_and_grads(problem(), replay_rows("replay"), mesh, "dispatch", fused=True),
              reference("replay", fused=True))


@pytest.mark.devices(8)
def test_replicate_equals_the_unsharded_layer():
  """Today's way (psum over `expert`) on the same problem, for comparison (expert=4, fsdp=2)."""
  mesh = parallel.make_mesh(jax.devices()[:8], expert=4, fsdp=2)
  assert_same(value_and_grads(problem(), replay_rows("replay"), mesh, "replicate"), reference("replay"))


@pytest.mark.devices(2)
def test_dense_all_to_all_gives_ragged_all_to_alls_result():
  """`_dense_all_to_all` on `jax.lax.ragged_all_to_all`'s docstring example (axis of 2): device 0
  sends [1] to 0 and [2, 2] to 1, device 1 sends [3] to 0 and [4] to 1 -> [1, 3, 0, 0], [2, 2, 4, 0]."""
  from jax.sharding import PartitionSpec as P

  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("expert",))
  per_device = {"operand": [[1, 2, 2], [3, 4, 0]], "input_offsets": [[0, 1], [0, 1]], "send_sizes": [[1, 2], [1, 1]],
                "output_offsets": [[0, 0], [1, 2]], "recv_sizes": [[1, 1], [2, 1]]}
  args = [jnp.asarray(v, jnp.float32 if k == "operand" else jnp.int32) for k, v in per_device.items()]

  def body(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
    return moe._dense_all_to_all(operand[0], jnp.zeros(4), input_offsets[0], send_sizes[0], output_offsets[0],
                                 recv_sizes[0], axis_name="expert", capacity=2)[None]

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert")))(*args)
  np.testing.assert_array_equal(np.asarray(out), [[1, 3, 0, 0], [2, 2, 4, 0]])


# Qwen3-30B-A3B's layer (configs/qwen3_30b_a3b.gin): 128 experts, top-8, embed 2048; 4096 tokens a group
A3B = {"k": 8, "embed": 2048, "num_experts": 128}


@pytest.mark.parametrize("shape,tokens,k,want", [
    ({"expert": 8}, 4096, 8, "replicate"),             # k / EP + 1/2 = 1.5 of replicate's bytes
    ({"expert": 4, "fsdp": 2}, 8192, 8, "replicate"),  # 2.5
    ({"expert": 2, "fsdp": 4}, 16384, 8, "replicate"),  # 4.5
    ({"expert": 8}, 4096, 2, "dispatch"),               # top-2: 0.75
    ({"expert": 4, "fsdp": 2}, 8192, 1, "dispatch"),   # top-1: 0.75
    ({"expert": 8}, 4100, 2, "replicate"),              # 4100 tokens do not split over 8 devices
    ({"fsdp": 8}, 4096, 2, "replicate"),                # no expert parallelism
])
def test_choose_expert_parallel_picks_the_way_that_sends_fewer_bytes(shape, tokens, k, want):
  assert moe.choose_expert_parallel(shape, tokens, **{**A3B, "k": k}) == want


def test_expert_parallel_bytes_at_qwen3_30b_a3b_shapes():
  """8 devices all on `expert`, 4096 tokens, bf16 rows of 2048: replicate's psum sends 2 * 7/8 of the
  16 MiB `[4096, 2048]` output (28 MiB); dispatch sends each device's 512 tokens' 8 rows twice at
  7/8 remote (14 MiB) plus the all-gather of the output (14 MiB) plus the counts (~0.5 KiB)."""
  sent = moe.expert_parallel_bytes({"expert": 8}, 4096, **A3B)
  mib = 2 ** 20
  assert sent["replicate"]["forward"] == 28 * mib
  assert sent["dispatch"]["forward"] == pytest.approx(42 * mib, abs=1024)
  assert sent["dispatch_dense"]["forward"] == pytest.approx((2 * 7 * 512 * 8 * 4096 + 14 * mib), abs=1024)
  # the backward: the same, on the gradients of x and of the routing weights [4096, 8]
  assert sent["replicate"]["backward"] == 2 * 7 / 8 * 4096 * (2048 + 8) * 2
  assert sent["dispatch"]["backward"] == pytest.approx(sent["dispatch"]["forward"] + 7 / 8 * 4096 * 8 * 2)


@pytest.mark.devices(8)
def test_refusals_name_the_choices():
  mesh = parallel.make_mesh(jax.devices()[:8], expert=8)
  p = problem()
  with pytest.raises(ValueError, match="expected one of .*'replicate', 'dispatch'"):
    layer_loss(p, None, mesh, "ragged")
  with pytest.raises(ValueError, match="multiple of 8"):
    moe.grouped_swiglu(p["x"][:60], jnp.zeros((60, K), jnp.int32), jnp.ones((60, K)), (p["w_gate"], p["w_up"]),
                       p["w_down"], mesh, expert_parallel="dispatch")


@pytest.mark.devices(8)
def test_collectives_counts_what_replicates_psum_sends():
  """`measure.hlo.collectives` on replicate's forward (CPU, expert=4 x fsdp=2): one all-reduce of each
  group's `[32, 16]` fp32 output over the 4 devices of `expert`, sending 2 * 3/4 of its 2 KiB; and
  the three forms XLA writes replica groups in."""
  from llamarl_jax.measure import hlo

  mesh = parallel.make_mesh(jax.devices()[:8], expert=4, fsdp=2)
  p = problem()
  weights, experts, _, _ = moe.route(p["x"], p["router"], K, True)
  fn = jax.jit(lambda x: moe.grouped_swiglu(x, experts, weights, (p["w_gate"], p["w_up"]), p["w_down"], mesh,
                                            expert_parallel="replicate"))
  found = hlo.collectives(fn.lower(p["x"]).compile().as_text())
  assert [(c["op"], c["result_bytes"], c["sent_bytes"]) for c in found] == [("all-reduce", 2048, 3072)]
  assert {frozenset(g) for g in found[0]["groups"]} == {frozenset((0, 1, 2, 3)), frozenset((4, 5, 6, 7))}
  assert hlo._replica_groups("replica_groups={{0,4},{1,5}}, x") == ((0, 4), (1, 5))
  assert hlo._replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert hlo._replica_groups("replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, x") == ((0, 2, 4, 6), (1, 3, 5, 7))


@pytest.mark.devices(8)
def test_rows_that_do_not_split_over_the_batch_axes_leave_those_axes_to_xla():
  """N = 63 rows on fsdp=2 x expert=4 (63 does not split over fsdp's 2 devices: a slot engine's prefill
  of an odd count of positions): the experts still run in parallel over `expert` (each device its own,
  replicate's psum), the batch axis is left to XLA, and the output is the unsharded one."""
  mesh = parallel.make_mesh(jax.devices()[:8], expert=4, fsdp=2)
  p = problem()
  weights, experts, _, _ = moe.route(p["x"][:63], p["router"], K, True)
  run = lambda m: np.asarray(jax.jit(lambda x: moe.grouped_swiglu(x, experts, weights, (p["w_gate"], p["w_up"]),
                                                                   p["w_down"], m))(p["x"][:63]))
  np.testing.assert_allclose(run(mesh), run(None), rtol=RTOL, atol=ATOL)


@pytest.mark.devices(8)
@pytest.mark.parametrize("shape,way", [({"fsdp": 2}, "replicate"), ({"expert": 2, "fsdp": 2}, "replicate"),
                                       ({"expert": 2, "fsdp": 2}, "dispatch")])
def test_bf16_layers_gradients_on_a_cpu_mesh(shape, way):
  """In bf16 the gradients of the weights replicated over a manual axis (and, under replicate, of x over
  `expert`) are sums over devices that XLA:CPU cannot compile in 16 bits; they are summed in fp32
  (`moe._wide_on_cpu`). The layer compiles and its output and gradients equal the unsharded bf16
  layer's to bf16 rounding: each is a sum of the same products whose partial sums are rounded to bf16
  (8 significant bits, 2^-8 relative) at other points, so a few such roundings apart: 3e-2 of the
  largest entry."""
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), problem())
  mesh = parallel.make_mesh(jax.devices()[:int(np.prod(list(shape.values())))], **shape)
  (out, grads), (want_out, want_grads) = (value_and_grads(params, replay_rows("replay"), m, w)
                                          for m, w in ((mesh, way), (None, None)))
  for name, got, want in [("output", out, want_out), *((n, grads[n], want_grads[n]) for n in want_grads)]:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    assert scale > 1e-3 and got.dtype == want.dtype, name
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * scale, err_msg=name)
