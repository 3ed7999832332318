"""The paged KV layout of the slot engine: attention over live blocks equals dense attention, the
block lists name exactly each running row's blocks (the n samples of a prompt share its prompt
blocks), the host's bound on the blocks of a chunk holds, and one decode step's bytes follow the live
lengths, not the cache's maximum.

Attention tolerance: both sides compute scores, softmax and sums in fp32 from the same fp32 inputs;
they differ only in summation order (a row's <= 32 positions, values O(1)): ~32 x 6e-8 ~ 2e-6
relative, so 1e-5 catches a wrong block, length, row or GQA head (errors of O(0.1)) with margin.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llamarl_jax.generation import Sampler, SamplingParams, paged
from llamarl_jax.generation.paged import PageLayout, live_blocks_bound, live_entries
from llamarl_jax.generation.slot_programs import SlotPrograms
from llamarl_jax.measure import hlo
from llamarl_jax.measure.decode_cost import decode_step_cost
from llamarl_jax.model import ModelConfig
from llamarl_jax.model.paged_attention import paged_attention_reference, paged_decode_attention

NB, BS, KV, H, D = 10, 4, 2, 6, 8  # GQA: 3 query heads per KV head


def numpy_attention(q, k_pool, v_pool, rows):
  """float64 reference: rows[b] = list of (block, length); one softmax over the concatenated positions."""
  B = q.shape[0]
  out = np.zeros((B, H, D))
  for b in range(B):
    if not rows[b]:
      continue
    k = np.concatenate([k_pool[blk, :n] for blk, n in rows[b]]).astype(np.float64)  # [T, KV, D]
    v = np.concatenate([v_pool[blk, :n] for blk, n in rows[b]]).astype(np.float64)
    for h in range(H):
      s = k[:, h // (H // KV)] @ q[b, 0, h].astype(np.float64) / np.sqrt(D)
      p = np.exp(s - s.max())
      out[b, h] = p / p.sum() @ v[:, h // (H // KV)]
  return out


def test_auto_implementation_follows_the_platform_compiled_for():
  """'auto' is 'dot' for the CPU and 'reduce' for accelerators: the default backend's, unless the
  program is traced for another platform (`target_platform`, which the slot programs set from
  their mesh: a GPU program compiled on a CPU-only machine must get the GPU's form)."""
  from llamarl_jax.model.paged_attention import resolve_paged_implementation, target_platform
  assert resolve_paged_implementation("auto", "cpu") == "dot"
  assert resolve_paged_implementation("auto", "gpu") == "reduce"
  with target_platform("gpu"):
    assert resolve_paged_implementation("auto") == "reduce"
    assert resolve_paged_implementation("dot") == "dot"
    for form in ("pallas", "pallas_fused"):
      with target_platform("gpu", form):  # a caller's choice reaches the model's 'auto'
        assert resolve_paged_implementation("auto") == form
    with target_platform(None):
      assert resolve_paged_implementation("auto") == ("dot" if jax.default_backend() == "cpu" else "reduce")
  assert resolve_paged_implementation("auto") == ("dot" if jax.default_backend() == "cpu" else "reduce")
  programs = SlotPrograms(COST_CONFIG, Sampler(COST_CONFIG), num_slots=2, sampling=SamplingParams(max_new_tokens=4),
                          max_prompt_len=8, chunk_steps=2, pad_id=0)
  assert programs.platform == jax.devices()[0].platform


@pytest.mark.parametrize("per_step", [1, 2, 4])
def test_pallas_kernel_equals_the_xla_forms_and_the_dense_reference(per_step):
  """The one-kernel form (Pallas interpret mode) on row-contiguous, row-ascending entries: ragged rows
  (a partial prompt block then response blocks), an idle row, two rows sharing prompt blocks, padding
  entries on a block of 1e4 keys; per_step blocks per loop step (entries past a row's count are
  masked, never its neighbour's). Tolerance as the XLA forms' (fp32, summation order)."""
  from llamarl_jax.model.paged_kernel import paged_decode_attention_kernel, row_spans
  rng = np.random.RandomState(1)
  k_pool = rng.randn(NB, BS, KV, D).astype(np.float32)
  v_pool = rng.randn(NB, BS, KV, D).astype(np.float32)
  k_pool[9] = 1e4
  q = (3 * rng.randn(4, 1, H, D)).astype(np.float32)
  rows = {0: [(2, 4), (3, 1), (6, 2)], 1: [], 2: [(7, 4), (8, 4), (4, 3)], 3: [(2, 4), (3, 1), (5, 3)]}
  entries = [(r, b, n) for r in range(4) for b, n in rows[r]] + [(4, 9, 0)] * 3
  row, block, length = (jnp.array(c, jnp.int32) for c in zip(*entries))
  np.testing.assert_array_equal(np.asarray(row_spans(row, 4)), [[0, 3], [3, 0], [3, 3], [6, 3]])
  expected = numpy_attention(q, k_pool, v_pool, rows)
  got = paged_decode_attention_kernel(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), row, block, length,
                                      per_step=per_step, interpret=True)
  np.testing.assert_allclose(np.asarray(got)[:, 0], expected, rtol=1e-5, atol=1e-5)
  xla = paged_decode_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), row, block, length, "dot")
  np.testing.assert_allclose(np.asarray(got), np.asarray(xla), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="power of two"):
    paged_decode_attention_kernel(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), row, block, length,
                                  per_step=3, interpret=True)


def test_kernel_bytes_count_each_live_block_of_each_head_once():
  """Hand count: 3 live entries of 4 positions x 2 KV heads x head dim 8 in bf16, k and v: 768 bytes;
  q padded to 16 rows per KV head (G = 2): 2 rows x 2 heads x 16 x 8 x 2 = 1024; the output, G = 2
  rows (a power of two: unpadded): 2 x 2 x 2 x 8 x 2 = 128; the decode step's write: each row's new
  key and value read and stored, 4 x 2 rows x 2 heads x 8 x 2 = 256. With q, k and v read from an
  fp8 GEMM's fp32 product (source_itemsize 4): q's G rows 2 x 2 x 2 x 8 x 4 = 256, the new key and
  value read 2 x 2 x 2 x 8 x 4 = 256 and stored 128."""
  from llamarl_jax.model.paged_kernel import kernel_bytes
  shapes = dict(num_rows=2, num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, live_entries=3, itemsize=2)
  assert kernel_bytes(**shapes, write=False) == 768 + 1024 + 128
  assert kernel_bytes(**shapes) == 768 + 1024 + 128 + 256
  assert kernel_bytes(**shapes, source_itemsize=4) == 768 + 256 + 128 + 256 + 128


@pytest.mark.parametrize("form", ["pallas_fused", "pallas"])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_kernel_writes_the_new_token_and_attends_as_the_scatter_then_the_xla_form(scaled, form):
  """`write_and_attend` with the Pallas kernel (interpret mode; 'pallas_fused': the key's RoPE and the
  write inside the kernel; 'pallas': XLA's rotation and scatters, then the read-only kernel; k and v read from channels 3 and 1 of a [B, KV, 4, D] projection output, the new token
  attended from registers) against the XLA form (`rope_rotate`, `write_token` scatters, then 'dot'):
  the same pools (the values bit for bit, the keys up to one fp32 rounding of the rotation) and the
  same outputs up to fp32 summation order. Row 1 is idle (no entries, writes to the trash block 9, gets zeros); rows 0 and 3 share
  prompt blocks and write into their own response blocks (the last listed position), whose stale
  contents must not be read. scaled: kv is an fp8 GEMM's fp32 product with row and column scales
  (`fp8.apply_scales` inside the kernel, as the XLA form applies them)."""
  from llamarl_jax.model.paged_attention import PagedLayer, rope_rotate, write_and_attend
  rng = np.random.RandomState(2)
  k_pool = rng.randn(NB, BS, KV, D).astype(np.float32)
  v_pool = rng.randn(NB, BS, KV, D).astype(np.float32)
  q = (3 * rng.randn(4, 1, H, D)).astype(np.float32)
  kv = rng.randn(4, KV, 4, D).astype(np.float32)
  angles = rng.uniform(0, 6, (4, D // 2)).astype(np.float32)
  cos, sin = (jnp.asarray(np.concatenate([f(angles)] * 2, axis=-1)) for f in (np.cos, np.sin))
  rows = {0: [(2, 4), (3, 1), (6, 2)], 1: [], 2: [(7, 4), (8, 4), (4, 3)], 3: [(2, 4), (3, 1), (5, 3)]}
  entries = [(r, b, n) for r in range(4) for b, n in rows[r]] + [(4, 9, 0)] * 3
  row, block, length = (jnp.array(c, jnp.int32) for c in zip(*entries))
  write_block, write_offset = jnp.array([6, 9, 4, 5], jnp.int32), jnp.array([1, 0, 2, 2], jnp.int32)
  layer = PagedLayer(jnp.asarray(k_pool), jnp.asarray(v_pool), write_block, write_offset, row, block, length)
  kv_scales = None
  if scaled:
    kv_scales = (jnp.asarray(rng.uniform(0.5, 2, 4).astype(np.float32)),
                 jnp.asarray(rng.uniform(0.5, 2, (KV, 4, D)).astype(np.float32)))
  args = (jnp.asarray(q), jnp.asarray(kv), (3, 1), cos, sin, layer)
  out, ck, cv = write_and_attend(*args, implementation=form, kv_scales=kv_scales)
  ref_out, ref_k, ref_v = write_and_attend(*args, implementation="dot", kv_scales=kv_scales)
  if scaled:
    from llamarl_jax.model.fp8 import apply_scales
    kv = np.asarray(apply_scales(jnp.asarray(kv), *kv_scales, jnp.float32))
  written = np.zeros((NB, BS), bool)
  written[np.asarray(write_block), np.asarray(write_offset)] = True
  np.testing.assert_array_equal(np.asarray(ck)[~written], k_pool[~written])  # nothing else touched
  np.testing.assert_array_equal(np.asarray(cv), np.asarray(ref_v))
  # the rotated key: the same fp32 products and sums, the kernel's on half vectors (1 ulp apart at most)
  np.testing.assert_allclose(np.asarray(ck), np.asarray(ref_k), rtol=3e-7, atol=1e-7)
  np.testing.assert_allclose(np.asarray(ck)[6, 1], np.asarray(rope_rotate(kv[0, :, 3], cos[0], sin[0])),
                             rtol=3e-7, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(cv)[4, 2], kv[2, :, 1])
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[1], 0.0)
  expected = numpy_attention(q, np.asarray(ref_k), np.asarray(ref_v), rows)
  np.testing.assert_allclose(np.asarray(out)[:, 0], expected, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("form", ["pallas_fused", "pallas"])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_kernel_reads_and_rotates_q_from_the_projection_output(scaled, form):
  """`write_and_attend(q_group=4)`: the queries are channels 0..3 of each KV head of a [B, KV, 6, D]
  fused projection output, before RoPE; the fused Pallas kernel (interpret mode) rotates and pads them
  itself and writes its output unpadded (G = 4); the read-only form takes them rotated by XLA's ops. Against the XLA form given q rotated by
  `rope_rotate` outside: the same outputs and pools up to fp32 summation order (2e-6, as above);
  the quantised output (`quantize_out`, `fp8_kernels.quantize_heads`) de-quantised is the output
  within e4m3's rounding (3 mantissa bits: 2^-4 relative; asserted 2^-3)."""
  from llamarl_jax.model.fp8 import apply_scales
  from llamarl_jax.model.paged_attention import PagedLayer, rope_rotate, write_and_attend
  G = 4
  rng = np.random.RandomState(3)
  k_pool = jnp.asarray(rng.randn(NB, BS, KV, D).astype(np.float32))
  v_pool = jnp.asarray(rng.randn(NB, BS, KV, D).astype(np.float32))
  kv = jnp.asarray(rng.randn(4, KV, G + 2, D).astype(np.float32))
  angles = rng.uniform(0, 6, (4, D // 2)).astype(np.float32)
  cos, sin = (jnp.asarray(np.concatenate([f(angles)] * 2, axis=-1)) for f in (np.cos, np.sin))
  rows = {0: [(2, 4), (3, 1), (6, 2)], 1: [], 2: [(7, 4), (8, 4), (4, 3)], 3: [(2, 4), (3, 1), (5, 3)]}
  entries = [(r, b, n) for r in range(4) for b, n in rows[r]] + [(4, 9, 0)] * 3
  row, block, length = (jnp.array(c, jnp.int32) for c in zip(*entries))
  layer = PagedLayer(k_pool, v_pool, jnp.array([6, 9, 4, 5], jnp.int32), jnp.array([1, 0, 2, 2], jnp.int32),
                     row, block, length)
  kv_scales = None
  scaled_kv = kv
  if scaled:
    kv_scales = (jnp.asarray(rng.uniform(0.5, 2, 4).astype(np.float32)),
                 jnp.asarray(rng.uniform(0.5, 2, (KV, G + 2, D)).astype(np.float32)))
    scaled_kv = apply_scales(kv, *kv_scales, jnp.float32)
  q = rope_rotate(scaled_kv[:, :, :G].reshape(4, 1, KV * G, D), cos[:, None, None], sin[:, None, None])
  channels = (G, G + 1)
  out, ck, cv = write_and_attend(None, kv, channels, cos, sin, layer, form, kv_scales, q_group=G)
  ref_out, ref_k, ref_v = write_and_attend(q, kv, channels, cos, sin, layer, "dot", kv_scales)
  assert out.shape == (4, 1, KV * G, D)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(np.asarray(ck), np.asarray(ref_k), rtol=3e-7, atol=1e-7)
  np.testing.assert_array_equal(np.asarray(cv), np.asarray(ref_v))
  rows_out = write_and_attend(None, kv, channels, cos, sin, layer, form, kv_scales, quantize_out=True,
                              q_group=G)[0]
  np.testing.assert_allclose(np.asarray(rows_out.values, np.float32) * np.asarray(rows_out.scale)[..., None],
                             np.asarray(ref_out).reshape(4, 1, KV * G * D), rtol=2 ** -3, atol=1e-6)


def test_decode_programs_compile_with_their_options_or_xlas_defaults_where_unknown():
  """`compile_lowered` passes the decode programs' XLA options (no split-K GEMMs) to the compiler;
  an XLA that does not know an option compiles with its defaults; any other error is raised."""
  from llamarl_jax.generation.program_set import DECODE_COMPILER_OPTIONS, compile_lowered

  class Lowered:  # records what it was compiled with; knows only `known`
    def __init__(self, known, error="INVALID_ARGUMENT: No such compile option: '{}'"):
      self.known, self.error, self.calls = known, error, []

    def compile(self, compiler_options=None):
      self.calls.append(compiler_options)
      unknown = [k for k in compiler_options or {} if k not in self.known]
      if unknown:
        raise RuntimeError(self.error.format(unknown[0]))
      return "compiled"

  assert DECODE_COMPILER_OPTIONS == {"xla_gpu_experimental_force_split_k": 1}
  lowered = Lowered(known=set(DECODE_COMPILER_OPTIONS))
  assert compile_lowered(lowered, DECODE_COMPILER_OPTIONS) == "compiled"
  assert lowered.calls == [DECODE_COMPILER_OPTIONS]
  older = Lowered(known=set())
  assert compile_lowered(older, DECODE_COMPILER_OPTIONS) == "compiled"
  assert older.calls == [DECODE_COMPILER_OPTIONS, None]
  broken = Lowered(known=set(), error="RESOURCE_EXHAUSTED: out of memory compiling {}")
  with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
    compile_lowered(broken, DECODE_COMPILER_OPTIONS)
  # jax's own compiler takes the option on this backend (the CPU's ignores a GPU option)
  real = jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((8, 8), jnp.float32))
  assert float(compile_lowered(real, DECODE_COMPILER_OPTIONS)(jnp.eye(8))[0, 0]) == 1.0


@pytest.mark.parametrize("implementation", ["reduce", "dot"])
def test_blocked_attention_equals_dense_attention(implementation):
  """Ragged rows: 7 positions over two blocks (prompt 5 + response 2 in separate blocks, as the engine
  lays them out), an idle row, 8 = 2 full blocks (a multiple of the block size), a row sharing the
  first row's prompt blocks; entries out of row order; padding entries on a garbage block."""
  rng = np.random.RandomState(0)
  k_pool = rng.randn(NB, BS, KV, D).astype(np.float32)
  v_pool = rng.randn(NB, BS, KV, D).astype(np.float32)
  k_pool[9] = 1e4  # trash: padding entries point here with length 0; must not leak
  q = (3 * rng.randn(4, 1, H, D)).astype(np.float32)  # large logits: the max subtraction matters
  rows = {0: [(2, 4), (3, 1), (6, 2)], 1: [], 2: [(7, 4), (8, 4)], 3: [(2, 4), (3, 1), (5, 3)]}
  entries = [(3, 5, 3), (0, 2, 4), (2, 8, 4), (0, 3, 1), (3, 2, 4), (0, 6, 2), (2, 7, 4), (3, 3, 1),
             (4, 9, 0), (4, 9, 0)]  # (row, block, length); row 4 = B: padding
  row, block, length = (jnp.array(c, jnp.int32) for c in zip(*entries))
  expected = numpy_attention(q, k_pool, v_pool, rows)
  got = paged_decode_attention(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), row, block, length,
                               implementation)
  np.testing.assert_allclose(np.asarray(got)[:, 0], expected, rtol=1e-5, atol=1e-5)
  ref = paged_attention_reference(jnp.asarray(q), jnp.asarray(k_pool), jnp.asarray(v_pool), row, block, length)
  np.testing.assert_allclose(np.asarray(ref)[:, 0], expected, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[1] == 0)  # the idle row


def test_live_entries_list_each_running_slots_prompt_and_response_blocks():
  """S=3, prompts up to 10 (3 blocks of 4), R=9 (8 written response tokens: 2 blocks per slot).
  Slots 0 and 2 are two samples of one prompt (region 1, length 5); slot 1 is idle. Slot 2's
  response fills exactly one block (n_gen 4)."""
  lay = PageLayout(num_slots=3, max_prompt_len=10, max_new_tokens=9, block_size=4)
  assert (lay.prompt_blocks, lay.response_blocks, lay.response_base, lay.trash, lay.num_blocks) == (3, 2, 9, 15, 16)
  region = jnp.array([1, 0, 1], jnp.int32)
  prompt_len = jnp.array([5, 7, 5], jnp.int32)
  n_gen = jnp.array([3, 2, 4], jnp.int32)
  running = jnp.array([True, False, True])
  row, block, length = map(np.asarray, live_entries(lay, region, prompt_len, n_gen, running, 8))
  np.testing.assert_array_equal(row, [0, 0, 0, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(block, [3, 4, 9, 3, 4, 13, 15, 15])
  np.testing.assert_array_equal(length, [4, 1, 3, 4, 1, 4, 0, 0])
  # prefix sharing: both samples read the same physical prompt blocks
  np.testing.assert_array_equal(block[row == 0][:2], block[row == 2][:2])
  wb, wo = map(np.asarray, lay.write_location(n_gen, running))
  np.testing.assert_array_equal(wb, [9, 15, 13])  # token n_gen - 1 of slots 0, 2; slot 1 writes to trash
  np.testing.assert_array_equal(wo, [2, 0, 3])


def test_the_hosts_bound_covers_every_step_of_the_chunk():
  """Random slots: whatever steps actually ran (<= those dispatched), every step of the next chunk
  reads at most `live_blocks_bound` blocks."""
  rng = np.random.RandomState(0)
  lay = PageLayout(num_slots=8, max_prompt_len=40, max_new_tokens=50, block_size=4)
  for _ in range(200):
    busy = rng.randint(1, 9)
    L = rng.randint(1, 41, busy)
    dispatched = rng.randint(0, 60, busy)
    ran = np.array([rng.randint(0, d + 1) for d in dispatched])  # a chunk may exit early
    bound = live_blocks_bound(lay, L, dispatched, chunk_steps=5)
    for i in range(5):  # the chunk's steps: n_gen = 1 + ran + i, while n_gen < R
      n_gen = 1 + ran + i
      live = n_gen < lay.max_new_tokens
      blocks = np.where(live, -(-L // 4) + -(-n_gen // 4), 0).sum()
      assert blocks <= bound


def test_entry_bucket_is_the_smallest_that_holds_the_bound():
  assert paged.entry_bucket(81, (160, 640)) == 160 and paged.entry_bucket(161, (160, 640)) == 640
  assert paged.entry_bucket(10 ** 6, (160, 640)) == 640  # the largest holds every lane at full length


def test_fused_index_overcount_charges_what_a_gather_reads():
  """XLA's CPU cost analysis charges a fused gather its whole operand; the overcount is that minus
  the gathered rows: here a [1000, 64] f32 table, 10 rows gathered."""
  table = jax.ShapeDtypeStruct((1000, 64), jnp.float32)
  idx = jax.ShapeDtypeStruct((10,), jnp.int32)
  compiled = jax.jit(lambda t, i: jnp.take(t, i, axis=0) * 2).lower(table, idx).compile()
  over = hlo.fused_index_overcount(compiled.as_text())
  if jax.default_backend() == "cpu":
    assert over == (1000 - 10) * 64 * 4


# The form a GPU compiler gives the paged step's token write: an in-place scatter fusion (the pool
# parameter is the scatter's target, the scatter is the root), and a gather fused into a reduction.
_FUSED_HLO = """HloModule m

%fused_scatter (param_0: f32[100,8], param_1: s32[4,1], param_2: f32[4,8]) -> f32[100,8] {
  %param_0 = f32[100,8]{1,0} parameter(0)
  %param_1 = s32[4,1]{1,0} parameter(1)
  %param_2 = f32[4,8]{1,0} parameter(2)
  ROOT %scatter.1 = f32[100,8]{1,0} scatter(%param_0, %param_1, %param_2), update_window_dims={1}, to_apply=%add
}

%fused_reduce (param_0.1: f32[100,8], param_1.1: s32[5,1]) -> f32[5] {
  %param_0.1 = f32[100,8]{1,0} parameter(0)
  %param_1.1 = s32[5,1]{1,0} parameter(1)
  %gather.1 = f32[5,8]{1,0} gather(%param_0.1, %param_1.1), offset_dims={1}, slice_sizes={1,8}
  %constant.1 = f32[] constant(0)
  ROOT %reduce.1 = f32[5]{0} reduce(%gather.1, %constant.1), dimensions={1}, to_apply=%add
}

ENTRY %main (a: f32[100,8], b: s32[4,1], c: f32[4,8], d: s32[5,1]) -> (f32[100,8], f32[5]) {
  %a = f32[100,8]{1,0} parameter(0)
  %b = s32[4,1]{1,0} parameter(1)
  %c = f32[4,8]{1,0} parameter(2)
  %d = s32[5,1]{1,0} parameter(3)
  %input_scatter_fusion = f32[100,8]{1,0} fusion(%a, %b, %c), kind=kInput, calls=%fused_scatter
  %input_reduce_fusion = f32[5]{0} fusion(%input_scatter_fusion, %d), kind=kInput, calls=%fused_reduce
  ROOT %t = (f32[100,8]{1,0}, f32[5]{0}) tuple(%input_scatter_fusion, %input_reduce_fusion)
}
"""


def test_fused_index_overcount_charges_a_scatter_its_updates_and_any_fused_gather_its_rows():
  """The scatter fusion is charged its whole [100, 8] f32 target read and written (2 x 3200 bytes);
  it touches 4 rows (128 bytes) each way. The gather inside a reduction fusion (kInput, not only
  the CPU's loop fusions) is charged the table (3200) for 5 rows (160)."""
  assert hlo.fused_index_overcount(_FUSED_HLO) == 2 * (3200 - 128) + (3200 - 160)


# A GEMM a GPU compiler handed to cuBLAS: a custom call with a workspace in its result tuple.
_CUBLAS_HLO = """HloModule m

ENTRY %main (x: bf16[64,2048], w: bf16[2048,8192]) -> bf16[64,8192] {
  %x = bf16[64,2048]{1,0} parameter(0)
  %w = bf16[2048,8192]{1,0} parameter(1)
  %custom-call.1 = (bf16[64,8192]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", backend_config={}
  %other = f32[8]{0} custom-call(%x), custom_call_target="something_else"
  ROOT %get-tuple-element.1 = bf16[64,8192]{1,0} get-tuple-element(%custom-call.1), index=0
}
"""


def test_library_call_bytes_charges_a_cublas_gemm_its_operands_and_output():
  """x [64, 2048], w [2048, 8192] in, [64, 8192] out, bf16: 2 x (131072 + 16777216 + 524288) bytes;
  the 4 MiB workspace and other custom calls are not counted."""
  assert hlo.library_call_bytes(_CUBLAS_HLO) == 2 * (64 * 2048 + 2048 * 8192 + 64 * 8192)
  assert hlo.library_call_bytes(_FUSED_HLO) == 0


# -- one decode step's bytes (XLA's cost analysis from abstract shapes) -------------------------------

# KV-heavy on purpose (weights ~0.5 MB, live KV ~20 MB): the attention's bytes dominate the step.
COST_CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                          num_kv_heads=4, head_dim=32)


def _step_cost(max_new_tokens, layout, exact=False):
  S, Pm = 16, 64
  rng = np.random.RandomState(0)
  live = rng.randint(100, 501, S)  # mean ~300, as the configuration
  prompt = np.minimum(rng.randint(16, Pm + 1, S), live - 1)
  sampling = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
  programs = SlotPrograms(COST_CONFIG, Sampler(COST_CONFIG), num_slots=S, sampling=sampling, max_prompt_len=Pm,
                          chunk_steps=8, pad_id=0)
  need = int(np.sum(-(-prompt // 16) + -(-(live - prompt) // 16)))
  return decode_step_cost(programs, prompt, live - prompt, layout=layout, num_entries=need if exact else None)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the bounds are the CPU compiler's")
@pytest.mark.slow
def test_decode_step_bytes_follow_live_lengths_not_the_cache_maximum():
  """16 rows of 100..500 live positions (mean ~300) in caches of 1024 and 2048 positions.

  Paged, listing the live blocks: the same bytes for both caches: nothing the step reads scales
  with the pool (the dense layout fails this: it reads every cached position, +1024 x 16 positions
  here). Measured on CPU 4.09x the ideal (weights + live KV) in this KV-heavy model, flat in the
  cache: the CPU's XLA materialises each gather before the matmul that reads it, so a live block
  moves ~3 times (read, write the gathered copy, read it), plus blocks and per-block partials
  (scores, sums: ~1x more at bs 16, 8 heads). Bound 4.5. Dense: 4.27x at 1024 positions, 8.38x at
  2048 (its KV bytes double with the cache); bound: >= 1.8x the paged step at 2048.
  The program set's entry counts (a quarter of the pool's and all of it, at the full width) read
  at most 4x the live blocks in an XLA form: its bytes here are within 4x the live-block step's."""
  paged_1k, paged_2k = _step_cost(960, "paged", exact=True), _step_cost(1984, "paged", exact=True)
  dense_1k, dense_2k = _step_cost(960, "dense"), _step_cost(1984, "dense")
  assert paged_1k["bytes"] == pytest.approx(paged_2k["bytes"], rel=0.01), (paged_1k, paged_2k)
  assert paged_2k["ratio"] <= 4.5, paged_2k
  extra_cache = 16 * (2048 - 1024) * paged.kv_bytes_per_position(COST_CONFIG)  # 1024 more positions x 16 rows
  assert dense_2k["bytes"] - dense_1k["bytes"] >= 0.9 * extra_cache, (dense_1k, dense_2k)
  assert dense_2k["bytes"] >= 1.8 * paged_2k["bytes"], (dense_2k, paged_2k)
  for R in (960, 1984):
    in_set = _step_cost(R, "paged")
    assert in_set["bytes"] <= 4 * _step_cost(R, "paged", exact=True)["bytes"], in_set


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the kernel compiles for real")
def test_decode_step_cost_refuses_the_interpreted_kernel():
  """On the CPU the Pallas kernel runs in interpret mode: XLA ops whose bytes are not the kernel's
  (46x the ideal at 5M): the cost says so instead of reporting them."""
  sampling = SamplingParams(temperature=0, max_new_tokens=64)
  programs = SlotPrograms(COST_CONFIG, Sampler(COST_CONFIG), num_slots=4, sampling=sampling, max_prompt_len=16,
                          chunk_steps=8, pad_id=0, paged_attention="pallas")
  with pytest.raises(ValueError, match="interpret mode.*bytes_target h100"):
    decode_step_cost(programs, np.full(4, 8), np.full(4, 8))


# Two Pallas (Triton) calls as a GPU's optimized HLO has them: an fp8 activation kernel and another.
_PALLAS_HLO = """HloModule m

ENTRY %main (x: bf16[64,2048], y: f32[64,2048], k: bf16[100,16,64]) -> bf16[64,2048] {
  %x = bf16[64,2048]{1,0} parameter(0)
  %y = f32[64,2048]{1,0} parameter(1)
  %k = bf16[100,16,64]{2,1,0} parameter(2)
  %pallas_call.1 = (bf16[64,2048]{1,0}, f8e4m3fn[64,2048]{1,0}, f32[64]{0}) custom-call(%x, %y), custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 64 : i32, name = "fp8_add_rms_norm_quantize", num_warps = 4 : i32}
  %pallas_call.2 = bf16[64,64]{1,0} custom-call(%k), custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 64 : i32, name = "paged_decode_attention_bs16_p4", num_warps = 4 : i32}
  ROOT %get-tuple-element.1 = bf16[64,2048]{1,0} get-tuple-element(%pallas_call.1), index=0
}
"""


def test_pallas_call_bytes_charges_the_named_kernels_their_operands_and_results():
  """The norm kernel reads x (bf16) and y (f32) [64, 2048] and writes [64, 2048] bf16 and fp8 and 64
  fp32 scales: 64 x 2048 x (2 + 4 + 2 + 1) + 256 bytes; the attention kernel is not named, so not
  counted (its pools' reads are `kernel_bytes`')."""
  from llamarl_jax.model.fp8_kernels import KERNEL_NAMES
  assert hlo.pallas_call_bytes(_PALLAS_HLO, KERNEL_NAMES) == 64 * 2048 * 9 + 256
  assert hlo.pallas_call_bytes(_PALLAS_HLO, ("other",)) == 0
