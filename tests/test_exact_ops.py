"""`model.exact`: every op computes a row's result bit for bit the same whatever the rows beside it.

"Equal" here is 0 ulp: `np.array_equal` on the bit patterns (uint32 for fp32, uint16 for bf16).
Each op is run on 1, 7, 64 and 2048 rows (fewer where the op is costly) and on the rows permuted,
and compared with the same rows of the largest run. Closeness to the plain op is checked separately
with a bound derived from the summation order (the only thing the exact forms change).

The last tests are the point of it all: a two-layer decoder written with these ops (the tiny
config's sizes) gives the same response log-probs bit for bit when the generator computes them
(prefill, then one token at a time over a KV cache, dense or paged as the slot engine lays it out,
3 rows) and when the trainer does (the whole sequence, 5 padded rows in another order, or packed rows).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax.model import exact

DTYPES = [jnp.float32, jnp.bfloat16]
ROWS = (1, 7, 64, 2048)


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_rows_invariant(f, x, *args, rows=ROWS):
  """f(x[:m], *args) equals f(x, *args)[:m] bit for bit for each m in rows, and f of the rows
  permuted equals the permuted rows (x: `[max(rows), ...]`; f maps rows to rows)."""
  g = jax.jit(f)
  full = bits(g(x, *args))
  for m in rows:
    np.testing.assert_array_equal(bits(g(x[:m], *args)), full[:m],
                                  err_msg=f"{m} rows differ from the same rows of {len(x)}")
  perm = np.random.default_rng(1).permutation(len(x))
  np.testing.assert_array_equal(bits(g(x[perm], *args)), full[perm], err_msg="a permutation of the rows changes them")


def normal(shape, dtype, seed=0, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


# ----------------------------------------------------------------------------------------------------
# per-row ops


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("k,n", [(128, 256), (128, 768), (384, 128), (128, 100)], ids=lambda v: str(v))
def test_dense_rows_invariant(dtype, k, n):
  # the tiny config's projections: fused qkv (256), gate_up (768), down (384 -> 128), lm_head (100)
  x, w = normal((2048, k), dtype), normal((k, n), dtype, 1, 1 / math.sqrt(k))
  assert_rows_invariant(lambda x, w: exact.dense(x, w), x, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dense_einsum_forms_rows_invariant(dtype):
  # 'bte,ehd->bthd' (wq) and wo [H, D, E] contracted over (H, D): rows are every (b, t)
  x, wq, wo = normal((64, 32, 128), dtype), normal((128, 4, 32), dtype, 1, 0.1), normal((4, 32, 128), dtype, 2, 0.1)
  f = lambda x: exact.dense(exact.dense(x, wq), wo, n_in=2)
  full = bits(jax.jit(f)(x))
  for b in (1, 7):
    np.testing.assert_array_equal(bits(jax.jit(f)(x[:b])), full[:b])
  np.testing.assert_array_equal(bits(jax.jit(f)(x[:, :5])), full[:, :5])  # fewer positions per row


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dense_close_to_plain(dtype):
  # Both sum K fp32 products; only the order differs, so |exact - plain| <= 2 K eps sum_k |x_k w_k|
  # (two orders, each within K eps of the exact sum), plus the final rounding to bf16 (one bf16 ulp).
  k = 384
  x, w = normal((64, k), dtype), normal((k, 128), dtype, 1, 1 / math.sqrt(k))
  got = np.asarray(exact.dense(x, w)).astype(np.float64)
  plain = np.asarray(jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(dtype)).astype(np.float64)
  mag = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
  bound = 2 * k * np.finfo(np.float32).eps * mag + (np.abs(plain) * 2.0 ** -7 if dtype == jnp.bfloat16 else 0)
  assert np.all(np.abs(got - plain) <= bound)


def test_dense_gradient_is_the_plain_one():
  x, w = normal((8, 64), jnp.float32), normal((64, 32), jnp.float32, 1, 0.1)
  gx, gw = jax.grad(lambda x, w: jnp.sum(jnp.sin(exact.dense(x, w))), argnums=(0, 1))(x, w)
  px, pw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(gx, px, rtol=1e-5, atol=1e-6)  # the forward values differ by ~1e-7
  np.testing.assert_allclose(gw, pw, rtol=1e-5, atol=1e-6)



# ----------------------------------------------------------------------------------------------------
# a mixture of experts' grouped matmuls and routing


def _grouped(x, groups, w, f):
  """f(rows sorted by group, w, sizes) for x `[R, K]` whose row i belongs to group groups[i], in x's
  row order again."""
  order = jnp.argsort(groups, stable=True)
  sizes = jnp.bincount(groups, length=w.shape[0]).astype(jnp.int32)
  out = f(jnp.take(x, order, axis=0), w, sizes)
  return jnp.zeros_like(out).at[order].set(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_grouped_dot_rows_invariant_and_close_to_ragged_dot(dtype):
  """Each row's product with its group's matrix is the same bits whatever the other rows and their
  groups (row counts 1 / 7 / 64 / 300, a permutation: other group sizes, other tile contents), and
  within the summation-order bound of `jax.lax.ragged_dot`'s."""
  R, K, N, G = 300, 96, 40, 5
  x, w = normal((R, K), dtype), normal((G, K, N), dtype, 1, 1 / math.sqrt(K))
  groups = jnp.asarray(np.random.default_rng(2).integers(0, G, R), jnp.int32)
  f = jax.jit(lambda x, g: _grouped(x, g, w, exact.grouped_dot))
  full = bits(f(x, groups))
  for m in (1, 7, 64, R):
    np.testing.assert_array_equal(bits(f(x[:m], groups[:m])), full[:m], err_msg=f"{m} rows")
  perm = np.random.default_rng(1).permutation(R)
  np.testing.assert_array_equal(bits(f(x[perm], groups[perm])), full[perm], err_msg="permuted rows")
  got = np.asarray(f(x, groups), np.float64)
  plain = np.asarray(_grouped(x, groups, w, jax.lax.ragged_dot), np.float64)
  mag = np.abs(np.asarray(x, np.float64))[:, None, :] @ np.abs(np.asarray(w, np.float64))[np.asarray(groups)]
  bound = 2 * K * np.finfo(np.float32).eps * mag[:, 0] + (np.abs(plain) * 2.0 ** -7 if dtype == jnp.bfloat16 else 0)
  assert np.all(np.abs(got - plain) <= bound)


def test_grouped_dot_gradient_is_ragged_dots():
  x, w = normal((50, 32), jnp.float32), normal((3, 32, 16), jnp.float32, 1, 0.2)
  sizes = jnp.asarray([20, 0, 25], jnp.int32)  # 5 rows past the groups: zero output, zero gradient
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w, sizes)))
  got = jax.grad(loss(exact.grouped_dot), argnums=(0, 1))(x, w)
  want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(x, w)
  for g, p in zip(got, want):  # the forward values differ by ~1e-7
    np.testing.assert_allclose(g, p, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got[0])[45:] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("replay", [False, True], ids=["own", "replay"])
def test_moe_layer_rows_invariant(dtype, replay):
  """A Qwen3-MoE layer's routing and experts with grouped_gemm='exact' (router logits, fp32 softmax,
  top-2 renormalised, the experts' SwiGLU, the weighted sum of the 2 choices): each token's output,
  weights, experts and probabilities are the same bits whatever the other tokens (with routing
  replay: the replayed experts, one token in four keeping its own)."""
  from llamarl_jax.model import moe

  X, E, F, k, N = 4, 32, 16, 2, 200
  router = normal((E, X), dtype, 1, 0.3)
  wg, wu, wd = normal((X, E, F), dtype, 2, 0.2), normal((X, E, F), dtype, 3, 0.2), normal((X, F, E), dtype, 4, 0.25)
  x = normal((N, E), dtype)
  rng = np.random.default_rng(5)
  chosen = np.stack([rng.permutation(X)[:k] for _ in range(N)]).astype(np.int32)
  chosen[rng.random(N) < 0.25] = -1
  xs = jnp.concatenate([x.astype(jnp.float32), jnp.asarray(chosen, jnp.float32)], axis=1)

  def layer(xs):
    x, rep = xs[:, :E].astype(dtype), xs[:, E:].astype(jnp.int32)
    w, e, p, own = moe.route(x, router, k, True, rep if replay else None, exact=True)
    out = moe.grouped_swiglu(x, e, w, (wg, wu), wd, grouped_gemm="exact")
    return jnp.concatenate([out.astype(jnp.float32), w.astype(jnp.float32), e.astype(jnp.float32), p], axis=1)

  assert_rows_invariant(layer, xs, rows=(1, 7, 64, N))
  if replay:  # the replayed rows use the given experts
    e = np.asarray(jax.jit(layer)(xs))[:, E + k:E + 2 * k]
    kept = chosen[:, 0] >= 0
    assert kept.sum() > 100 and np.array_equal(e[kept], chosen[kept])


@pytest.mark.parametrize("name", ["token_logprob", "log_softmax", "logsumexp", "temper", "rms_norm", "rope"])
def test_elementwise_forms_differentiate_as_the_plain_ops(name):
  """Each form stores values through `opaque` (an integer bitcast, whose own derivative is 0); the
  gradient is the plain op's (fp32: the forward values differ by an ulp or two, 1e-5 relative)."""
  x = normal((8, 64), jnp.float32, 2, 2.0)
  t = jnp.asarray(np.random.default_rng(3).integers(0, 64, 8), jnp.int32)
  s = normal((64,), jnp.float32, 4)
  cos, sin = jnp.cos(x), jnp.sin(x)
  forms = {
      "token_logprob": (lambda x: exact.token_logprob(x, t, 0.8),
                        lambda x: jnp.take_along_axis(jax.nn.log_softmax(x / 0.8), t[:, None], 1)[:, 0]),
      "log_softmax": (exact.log_softmax, jax.nn.log_softmax),
      "logsumexp": (exact.logsumexp, lambda x: jax.nn.logsumexp(x, axis=-1)),
      "temper": (lambda x: exact.temper(x, 0.8), lambda x: x / 0.8),
      "rms_norm": (lambda x: exact.rms_norm(x, s, 1e-5), lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True)
                                                                                     + 1e-5) * s),
      "rope": (lambda x: exact.rope(x, cos, sin),
               lambda x: x * cos + jnp.concatenate([-x[:, 32:], x[:, :32]], -1) * sin)}
  form, plain = forms[name]
  w = normal(jax.eval_shape(plain, x).shape, jnp.float32, 5)
  got = jax.grad(lambda x: jnp.sum(w * form(x)))(x)
  want = jax.grad(lambda x: jnp.sum(w * plain(x)))(x)
  assert float(jnp.max(jnp.abs(want))) > 0.01
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rms_norm_rows_invariant_and_close(dtype):
  x, scale = normal((2048, 128), dtype, scale=3.0), normal((128,), dtype, 1)
  assert_rows_invariant(lambda x, s: exact.rms_norm(x, s, 1e-6), x, scale)
  xf = np.asarray(x, np.float64)
  want = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + 1e-6) * np.asarray(scale, np.float64)
  tol = 1e-5 if dtype == jnp.float32 else 2 * 2.0 ** -8  # fp32: a few ulps; bf16: two roundings of 2^-8
  np.testing.assert_allclose(np.asarray(exact.rms_norm(x, scale, 1e-6), np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("vocab", [100, 1000])
def test_token_logprob_rows_invariant_and_close(dtype, vocab):
  logits = normal((2048, vocab), dtype, scale=4.0)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, vocab, 2048), jnp.int32)
  rows = jnp.concatenate([logits.astype(jnp.float32), tokens[:, None].astype(jnp.float32)], axis=1)
  f = lambda r: exact.token_logprob(r[:, :-1], r[:, -1].astype(jnp.int32))  # tokens travel with their rows
  assert_rows_invariant(f, rows)
  want = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)[np.arange(2048), np.asarray(tokens)]
  # fp32 sums of `vocab` terms in two orders: ~vocab * eps relative on log(sum), absolute on the log-prob
  np.testing.assert_allclose(np.asarray(f(rows)), want, atol=vocab * 2 * np.finfo(np.float32).eps)


def test_token_logprob_temperature_traced_or_constant():
  # the sampler may pass a traced temperature, the trainer a Python float: the same bits
  logits = normal((64, 100), jnp.float32, scale=4.0)
  tokens = jnp.asarray(np.arange(64) % 100, jnp.int32)
  const = jax.jit(lambda x, t: exact.token_logprob(x, t, 0.7))(logits, tokens)
  traced = jax.jit(exact.token_logprob)(logits, tokens, jnp.float32(0.7))
  np.testing.assert_array_equal(bits(const), bits(traced))
  want = jax.nn.log_softmax(np.asarray(logits, np.float64) / 0.7, axis=-1)[np.arange(64), np.asarray(tokens)]
  np.testing.assert_allclose(np.asarray(const), want, atol=1e-5)


def test_tree_sum_is_a_fixed_pairwise_order():
  x = normal((3, 5), jnp.float32)
  xs = np.asarray(x)
  pad = np.concatenate([xs, np.zeros((3, 3), np.float32)], 1)  # 5 -> 8
  lvl = pad[:, :4] + pad[:, 4:]
  lvl = lvl[:, :2] + lvl[:, 2:]
  np.testing.assert_array_equal(bits(exact.tree_sum(x)), bits(lvl[:, 0] + lvl[:, 1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_rope_swiglu_add_rows_invariant(dtype):
  x = normal((2048, 4, 32), dtype)
  ang = jnp.broadcast_to(jnp.arange(2048, dtype=jnp.float32)[:, None, None] * jnp.linspace(0.001, 1, 32), x.shape)
  rows = jnp.concatenate([x.astype(jnp.float32), jnp.cos(ang), jnp.sin(ang)], axis=-1)
  f = lambda r: exact.rope(r[..., :32].astype(dtype), r[..., 32:64], r[..., 64:])
  assert_rows_invariant(f, rows)
  g = lambda r: exact.add(r[..., :32].astype(dtype),
                          exact.swiglu(r[..., 32:64].astype(dtype), r[..., 64:].astype(dtype)))
  assert_rows_invariant(g, rows)


# ----------------------------------------------------------------------------------------------------
# attention


def _qkv(dtype, B=6, T=37, L=40, H=4, KV=2, D=32, seed=0):
  return (normal((B, T, H, D), dtype, seed), normal((B, L, KV, D), dtype, seed + 1),
          normal((B, L, KV, D), dtype, seed + 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_attention_decode_equals_full_sequence(dtype):
  """Query t of a causal full-sequence pass == the same query alone over a longer cache whose
  slots past t hold anything, with other rows of other lengths beside it."""
  q, k, v = _qkv(dtype)
  B, T = q.shape[:2]
  causal = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None] + 1, (B, T))
  full = bits(jax.jit(exact.attention)(q, k[:, :T], v[:, :T], causal))
  decode = jax.jit(exact.attention)
  rng = np.random.default_rng(3)
  for t in (0, 5, 15, 16, 17, 36):
    pos = jnp.asarray(rng.integers(0, T, B)).at[0].set(t)  # row 0 at t, the others anywhere
    qs = jnp.take_along_axis(q, pos[:, None, None, None], axis=1)
    live = (jnp.arange(k.shape[1]) <= pos[:, None])[..., None, None]
    k_rows = jnp.where(live, k, normal(k.shape, dtype, 9 + t))  # garbage past each row's length
    v_rows = jnp.where(live, v, normal(v.shape, dtype, 19 + t))
    got = bits(decode(qs, k_rows, v_rows, (pos + 1)[:, None].astype(jnp.int32)))
    np.testing.assert_array_equal(got[:, 0], full[np.arange(B), np.asarray(pos)], err_msg=f"t={t}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_attention_rows_and_queries_invariant(dtype):
  q, k, v = _qkv(dtype)
  B, T = q.shape[:2]
  lengths = jnp.asarray(np.random.default_rng(4).integers(1, 41, (B, T)), jnp.int32)
  f = jax.jit(exact.attention)
  full = bits(f(q, k, v, lengths))
  np.testing.assert_array_equal(bits(f(q[:1], k[:1], v[:1], lengths[:1])), full[:1])
  np.testing.assert_array_equal(bits(f(q[:, 3:10], k, v, lengths[:, 3:10])), full[:, 3:10])
  perm = np.array([4, 0, 5, 2, 1, 3])
  np.testing.assert_array_equal(bits(f(q[perm], k[perm], v[perm], lengths[perm])), full[perm])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_attention_packed_equals_padded(dtype):
  """Two sequences packed in one row (the second starting at offset 11) == each alone from position 0."""
  q, k, v = _qkv(dtype, B=2, T=24, L=24)
  n0, n1 = 11, 13
  packed = [jnp.concatenate([a[0, :n0], a[1, :n1]])[None] for a in (q, k, v)]
  positions = jnp.concatenate([jnp.arange(n0), jnp.arange(n1)])[None].astype(jnp.int32)
  starts = jnp.arange(n0 + n1, dtype=jnp.int32)[None] - positions
  got = bits(jax.jit(exact.attention)(*packed, positions + 1, starts))[0]
  causal = jnp.broadcast_to(jnp.arange(24, dtype=jnp.int32)[None] + 1, (2, 24))
  pad = bits(jax.jit(exact.attention)(q, k, v, causal))
  np.testing.assert_array_equal(got[:n0], pad[0, :n0])
  np.testing.assert_array_equal(got[n0:], pad[1, :n1])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_attention_close_to_reference(dtype):
  # fp32: the same softmax summed in another order (~1e-6 relative); bf16: the output's rounding (2^-8)
  q, k, v = _qkv(dtype)
  lengths = jnp.asarray(np.random.default_rng(4).integers(1, 41, q.shape[:2]), jnp.int32)
  tol = 2e-6 if dtype == jnp.float32 else 2.0 ** -8
  got = exact.attention(q, k, v, lengths).astype(jnp.float32)
  want = exact.attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), lengths)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_paged_attention_equals_contiguous():
  """Rows laid out as the slot engine does (a prompt block, then response blocks from offset 0, in
  any pool order; pool blocks of 8, attention blocks of 16) == the same positions contiguous."""
  q, k, v = _qkv(jnp.float32, B=3, T=1, L=40)
  bs, prompt_len = 8, np.array([5, 12, 3])
  lengths = np.array([40, 20, 9])
  index = np.zeros((3, 40), np.int32)
  k_pool, v_pool = np.zeros((40, bs, 2, 32), np.float32), np.zeros((40, bs, 2, 32), np.float32)
  free = iter(np.random.default_rng(6).permutation(40))
  for b in range(3):
    blocks = {}
    for p in range(40):
      r = p - prompt_len[b]
      region, off = (("prompt", p // bs), p % bs) if r < 0 else (("response", r // bs), r % bs)
      if region not in blocks:
        blocks[region] = next(free)
      index[b, p] = blocks[region] * bs + off
      k_pool[blocks[region], off], v_pool[blocks[region], off] = k[b, p], v[b, p]
  got = exact.paged_attention(q, jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(index), jnp.asarray(lengths))
  want = exact.attention(q, k, v, jnp.asarray(lengths)[:, None])
  np.testing.assert_array_equal(bits(got), bits(want))


def test_attention_gradient_is_the_reference_one():
  q, k, v = _qkv(jnp.float32, B=2, T=8, L=8)
  lengths = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32)[None] + 1, (2, 8))
  loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, lengths)))
  got = jax.grad(loss(exact.attention), argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(exact.attention_reference), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# a decoder from these ops: the generator's log-probs == the trainer's


E, H, KV, D, F, V, LAYERS = 128, 4, 2, 32, 384, 100, 2  # configs/tiny_cpu.gin's sizes, two layers
TEMPERATURE = 0.8  # the trainer's (a Python float); the generator's is traced


def _params(dtype):
  keys = iter(range(100))
  w = lambda *shape: normal(shape, dtype, next(keys), 1 / math.sqrt(shape[0]))
  layer = lambda: dict(attn_norm=jnp.ones((E,), dtype), wq=w(E, H, D), wk=w(E, KV, D), wv=w(E, KV, D),
                       wo=normal((H, D, E), dtype, next(keys), 1 / math.sqrt(H * D)), mlp_norm=jnp.ones((E,), dtype),
                       w_gate=w(E, F), w_up=w(E, F), w_down=w(F, E))
  return dict(embed=normal((V, E), dtype, 99, 0.5), layers=[layer() for _ in range(LAYERS)],
              final_norm=jnp.ones((E,), dtype))


def _cos_sin(positions):
  inv = 1.0 / (10000.0 ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
  cos, sin = exact.rope_cos_sin(positions, inv)
  return cos[..., None, :], sin[..., None, :]  # [B, T, 1, D]


def _block(p, x, positions, attend):
  """One decoder layer; attend(q, k, v) -> attention output (the caller's cache and lengths)."""
  h = exact.rms_norm(x, p["attn_norm"], 1e-5)
  cos, sin = _cos_sin(positions)
  q = exact.rope(exact.dense(h, p["wq"]), cos, sin)
  k = exact.rope(exact.dense(h, p["wk"]), cos, sin)
  x = exact.add(x, exact.dense(attend(q, k, exact.dense(h, p["wv"])), p["wo"], n_in=2))
  h = exact.rms_norm(x, p["mlp_norm"], 1e-5)
  return exact.add(x, exact.dense(exact.swiglu(exact.dense(h, p["w_gate"]), exact.dense(h, p["w_up"])), p["w_down"]))


def _head(params, x):
  return exact.rms_norm(x, params["final_norm"], 1e-5)


@functools.partial(jax.jit, static_argnames="scan")
def _trainer_logprobs(params, tokens, lengths, positions, starts, scan=False):
  """Full-sequence forward: tokens `[B, T]`; lengths `[B, T]` (keys per query), positions, starts
  `[B, T]` (packed rows) -> log-prob of tokens[:, t + 1] at every t `[B, T - 1]`. scan: the layers
  under `lax.scan` over stacked weights (the trainer's `scan_layers`), else unrolled."""
  x = jnp.take(params["embed"], tokens, axis=0)
  layer = lambda x, p: (_block(p, x, positions, lambda q, k, v: exact.attention(q, k, v, lengths, starts)), None)
  if scan:
    x, _ = jax.lax.scan(layer, x, jax.tree.map(lambda *w: jnp.stack(w), *params["layers"]))
  for p in [] if scan else params["layers"]:
    x, _ = layer(x, p)
  return exact.lm_head_logprobs(_head(params, x)[:, :-1], params["embed"].T, tokens[:, 1:], TEMPERATURE)


@functools.partial(jax.jit, static_argnames="slots")
def _generator_logprobs(params, prompts, prompt_len, responses, temperature, index=None, slots=0):
  """Prefill right-padded prompts `[B, P]` (lengths `[B]`), then decode the given responses `[B, R]`
  one token per step over a KV cache per layer; returns each response token's log-prob `[B, R]`
  (the token at step i predicted from the state after token i - 1). The cache: `[B, P + R, KV, D]`,
  or with `index` `[B, P + R]` a pool of `slots` (position p of row b at slot index[b, p]) read by
  `exact.paged_attention`."""
  B, P = prompts.shape
  R = responses.shape[1]
  dt = params["embed"].dtype
  shape = (B, P + R, KV, D) if index is None else (slots, KV, D)
  caches = [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in params["layers"]]
  positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))

  def write(c, a, pos, real):  # a [B, T, KV, D] at positions pos [B, T] (paged: where real, as the engine)
    if index is None:
      return jax.vmap(lambda c, a, j: jax.lax.dynamic_update_slice_in_dim(c, a, j, axis=0))(c, a, pos[:, 0])
    slot = jnp.where(real, jnp.take_along_axis(index, pos, axis=1), slots)  # a prompt's padding: dropped
    return c.at[slot].set(a, mode="drop")

  x = jnp.take(params["embed"], prompts, axis=0)
  new = []
  for p, (ck, cv) in zip(params["layers"], caches):
    def attend(q, k, v, ck=ck, cv=cv):
      real = positions < prompt_len[:, None]
      new.append((write(ck, k, positions, real), write(cv, v, positions, real)))
      return exact.attention(q, k, v, positions + 1)
    x = _block(p, x, positions, attend)
  caches = new
  last = jnp.take_along_axis(_head(params, x), (prompt_len - 1)[:, None, None], axis=1)  # [B, 1, E]
  first = exact.lm_head_logprobs(last, params["embed"].T, responses[:, :1], temperature)[:, 0]

  def step(caches, i):  # token i of the response in, the log-prob of token i + 1 out
    pos = (prompt_len + i)[:, None]  # [B, 1]: each row at its own position
    x = jnp.take(params["embed"], jax.lax.dynamic_slice_in_dim(responses, i, 1, axis=1), axis=0)
    new = []
    for p, (ck, cv) in zip(params["layers"], caches):
      def attend(q, k, v, ck=ck, cv=cv):
        ck, cv = write(ck, k, pos, True), write(cv, v, pos, True)
        new.append((ck, cv))
        if index is None:
          return exact.attention(q, ck, cv, pos + 1)
        pool = lambda c: c.reshape(-1, 8, KV, D)  # blocks of 8 slots (the attention's are 16 positions)
        return exact.paged_attention(q, pool(ck), pool(cv), index, pos[:, 0] + 1)
      x = _block(p, x, pos, attend)
    nxt = jax.lax.dynamic_slice_in_dim(responses, i + 1, 1, axis=1)
    return new, exact.lm_head_logprobs(_head(params, x), params["embed"].T, nxt, temperature)[:, 0]

  _, rest = jax.lax.scan(step, caches, jnp.arange(R - 1))
  return jnp.concatenate([first[:, None], rest.T], axis=1)


def _engine_index(prompt_len, P, R, bs=8, seed=7):
  """(pool slots `[B, P + R]`, the pool's size) laid out as the slot engine's: the prompt's positions in
  its own blocks, the response's from offset 0 of its own blocks, the blocks anywhere in the pool."""
  B = len(prompt_len)
  n_blocks = B * (-(-P // bs) + -(-(P + R) // bs))
  free = iter(np.random.default_rng(seed).permutation(n_blocks))
  index = np.zeros((B, P + R), np.int32)
  for b in range(B):
    prompt = [next(free) for _ in range(-(-P // bs))]
    response = [next(free) for _ in range(-(-(P + R) // bs))]
    for p in range(P + R):
      r = p - prompt_len[b]
      index[b, p] = (prompt[p // bs] * bs + p % bs) if r < 0 else (response[r // bs] * bs + r % bs)
  return index, n_blocks * bs


@pytest.mark.parametrize("dtype,cache", [(jnp.float32, "dense"), (jnp.bfloat16, "dense"), (jnp.float32, "paged"),
                                         (jnp.bfloat16, "paged")], ids=lambda v: getattr(v, "__name__", v))
def test_generator_logprobs_equal_trainer_logprobs(dtype, cache):
  params = _params(dtype)
  rng = np.random.default_rng(5)
  P, R = 8, 6
  prompt_len = np.array([5, 8, 3])
  prompts = rng.integers(4, V, (3, P)) * (np.arange(P)[None] < prompt_len[:, None])
  responses = rng.integers(4, V, (3, R))
  index, slots = (None, 0) if cache == "dense" else _engine_index(prompt_len, P, R)
  gen = bits(_generator_logprobs(params, jnp.asarray(prompts, jnp.int32), jnp.asarray(prompt_len, jnp.int32),
                                 jnp.asarray(responses, jnp.int32), jnp.float32(TEMPERATURE),
                                 None if index is None else jnp.asarray(index), slots=slots))

  # the trainer: the same 3 sequences among 5 rows, in another order, right-padded to 16
  seqs = [np.concatenate([prompts[b, :prompt_len[b]], responses[b]]) for b in range(3)]
  seqs = [rng.integers(4, V, 10), seqs[2], seqs[0], rng.integers(4, V, 16), seqs[1]]
  T = 16
  tokens = np.stack([np.pad(s, (0, T - len(s))) for s in seqs])
  causal = np.broadcast_to(np.arange(T) + 1, (5, T))
  positions = np.broadcast_to(np.arange(T), (5, T))
  lp = bits(_trainer_logprobs(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(causal, jnp.int32),
                              jnp.asarray(positions, jnp.int32), None))
  for b, row in ((0, 2), (1, 4), (2, 1)):
    n = prompt_len[b]
    np.testing.assert_array_equal(lp[row, n - 1:n - 1 + R], gen[b], err_msg=f"sequence {b} (padded row {row})")
  if cache == "dense":  # the layers under lax.scan: the same bits
    lp_scan = _trainer_logprobs(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(causal, jnp.int32),
                                jnp.asarray(positions, jnp.int32), None, scan=True)
    np.testing.assert_array_equal(bits(lp_scan), lp)

  # packed: the three sequences end to end in one row of 40 (positions restart at 0 in each)
  packed = np.concatenate(seqs[1:3] + [seqs[4]])
  pos = np.concatenate([np.arange(len(s)) for s in (seqs[1], seqs[2], seqs[4])])
  Tp = 40
  tokens_p = np.pad(packed, (0, Tp - len(packed)))[None]
  pos_p = np.pad(pos, (0, Tp - len(pos)))[None]
  starts_p = np.arange(Tp)[None] - pos_p
  lp_p = bits(_trainer_logprobs(params, jnp.asarray(tokens_p, jnp.int32), jnp.asarray(pos_p + 1, jnp.int32),
                                jnp.asarray(pos_p, jnp.int32), jnp.asarray(starts_p, jnp.int32)))[0]
  offset = 0
  for b in (2, 0, 1):
    n = prompt_len[b]
    np.testing.assert_array_equal(lp_p[offset + n - 1:offset + n - 1 + R], gen[b], err_msg=f"sequence {b} (packed)")
    offset += n + R
