"""`make run-gpu`'s configuration with `RolloutConfig.exact_logprobs` (`ModelConfig.exact`: every op in
`model.exact`'s batch-invariant form) compiled for an H100, beside the default mode: the slot engine's
full-width decode program and the padded train step, their figures (`figures`) and XLA's FLOPs
(`hlo.generic_cost_analysis`, recorded in bounds.json as `exact/flops/*`). The cost analysis counts a
while loop's body once: the decode figures are one decode step's (the exact `dense` over 64 slots is
one tile, its `lax.map` of one trip inlined), the train step's FLOPs and bytes are each loop body's
once (layers, microbatches and, with exact, the tiles of rows), so they compare programs of one loop
structure, not the exact step with the default's; its kernel counts are per iteration (`Figures`).

configs/llama3_1b_1gpu.gin samples unfiltered (top_k 0, top_p 1), with a bf16 generator and bf16
compute, one device: nothing it sets is refused with the switch. What the optimized HLO shows of the
exact forms, read from the dots of `Program.text` (`_dots`):
  - decode: every dot is one tile of 64 slots (`exact.ROW_TILE`) against a whole weight, accumulated
    in fp32, unbatched (no split of K: a split-K GEMM is a dot batched over K's parts and a reduce;
    the programs compile with split-K off, `exact.COMPILER_OPTIONS`), the lm_head reading its
    weight row-major ([K, N]: no transpose folded into the dot), each projection its own GEMM (the
    tiles' zeros read the weights, so XLA's dot merger finds no two dots of one operand to join, as
    it joined wq|wk|wv into one [64, 2048] @ [2048, 3072]). The (M, K, N) of the dots is recorded
    (`exact/engine/decode_dots`).
  - the train step: its forward runs the same (M, K, N) GEMMs, unbatched, and its backward the
    weights' gradients with the plain GEMMs (`exact.dense`'s custom VJP; the batched fp32 dots are
    the attention backward's, `exact.attention_reference`).
"""

import functools
import re

from cuda_compile import h100
from llamarl_jax.build import abstract_trainer
from llamarl_jax.measure import hlo
from llamarl_jax.model import exact

EXACT = ("RolloutConfig.exact_logprobs = True",)
TILE = exact.ROW_TILE
_DOT = re.compile(r"= (\w+)\[([0-9,]*)\]\{[^}]*\} dot\(([^)]*)\), ([^\n]*)")
_DIMS = re.compile(r"(lhs_batch|lhs_contracting|rhs_batch|rhs_contracting)_dims=\{([0-9,]*)\}")


@functools.cache
def _decode(bindings: tuple) -> tuple:
  """(name, Program) of the full-width decode program (`('decode', slots, entries)`) in the engine's
  own attention, the run of `bindings`."""
  run = h100.load_run(h100.RUN_GPU, *bindings)
  programs = h100.slot_programs(run, h100.meshes(run)[1])
  width = programs.widths[0]
  key = ("decode", width, programs.entry_plan[width][-1])
  key_name = "_".join(map(str, key))
  mode = f"bf16_exact/{key_name}" if bindings else f"bf16/{key_name}/{programs.attention_form}"
  return f"engine/{mode}", h100.compile_slot_program(programs, key)


@functools.cache
def _train(bindings: tuple) -> tuple:
  """(name, Program) of the padded train step, the run of `bindings`."""
  run = h100.load_run(h100.RUN_GPU, *bindings)
  trainer = abstract_trainer(run.model, run.config, h100.meshes(run)[0])
  s = run.shapes
  lowered = trainer.lower_step(s.rows, s.prompt_limit, s.response_width)
  return "train/padded" + ("_exact" if bindings else ""), h100.compile_program(lowered.compile)


def _dots(text: str) -> list[dict]:
  """Every dot of an optimized HLO module: its result dtype and shape, and its operands' batch and
  contracting dimensions (by operand position), with the operands' shapes where the dot's
  computation declares them (a GEMM fusion's parameters)."""
  shapes = dict(re.findall(r"%([^\s=]+) = (\w+\[[0-9,]*\])", text))
  out = []
  for dtype, dims, operands, rest in _DOT.findall(text):
    attrs = {k: tuple(int(d) for d in v.split(",") if d) for k, v in _DIMS.findall(rest)}
    names = [o.strip().lstrip("%") for o in operands.split(",")]
    out.append({"dtype": dtype, "shape": tuple(int(d) for d in dims.split(",") if d),
                "operands": [shapes.get(n) for n in names], **attrs})
  return out


def _mkn(dot: dict) -> tuple:
  """(M, K, N) of an unbatched dot whose tile of rows is one operand: M the tile's rows, K the
  contracted size, N the weight's other dimension."""
  lhs, rhs = (tuple(int(d) for d in s.split("[")[1].rstrip("]").split(",")) for s in dot["operands"])
  k = lhs[dot["lhs_contracting"][0]]
  m, n = (d for d in dot["shape"])
  if TILE not in (m, n):
    return (m, k, n)
  return (TILE, k, n if m == TILE else m)


def _flops(program) -> float:
  return float(hlo.generic_cost_analysis(program.compiled)["flops"])


def _check_flops(name: str, default, exact_program) -> None:
  """XLA's FLOPs of the default and the exact program, against bounds.json's `exact/flops/<name>`
  (the `_tolerance`'s relative band; written there when recording)."""
  got = {"default": _flops(default), "exact": _flops(exact_program)}
  recorded = h100.recorded(f"exact/flops/{name}", got)
  assert recorded is not None, f"no exact/flops/{name} in bounds.json: record it ({h100.RECORD_ENV}=1)"
  tol = h100.read_bounds()["_tolerance"]["relative"]
  for mode, value in got.items():
    assert abs(value - recorded[mode]) <= tol * recorded[mode], (
        f"{mode} {name} FLOPs {value:.4g}, recorded {recorded[mode]:.4g} +- {tol:.0%}")


def _gemm_results(text: str) -> list[tuple]:
  """The result shapes of every GEMM: the dots, and cuBLAS calls (the tuple's first element)."""
  shapes = [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"= \w+\[([0-9,]*)\]\{[^}]*\} dot\(", text)]
  cublas = r"= \(\w+\[([0-9,]*)\][^)]*\) custom-call\([^)]*\), custom_call_target=\"__cublas"
  shapes += [tuple(int(d) for d in m.split(",") if d) for m in re.findall(cublas, text)]
  return shapes


def _has_weight_gradient(text: str) -> bool:
  """Whether a GEMM computes a [K, N] weight's gradient: a result whose last two dimensions are both
  wider than a tile of rows (every forward dot of the exact step has the tile's 64 rows)."""
  return any(len(s) >= 2 and min(s[-2:]) > TILE for s in _gemm_results(text))


def test_decode_program(figures):
  """The exact full-width decode program beside the default's: figures, FLOPs, and its dots."""
  name, program = _decode(EXACT)
  figures.add(name, program)
  figures.add(*_decode(()))
  _check_flops("decode", _decode(())[1], program)
  dots = _dots(program.text)
  assert dots, "the exact decode program has no dot"
  for dot in dots:
    assert dot["dtype"] == "f32", f"a dot of the exact decode program rounds to {dot['dtype']}: {dot}"
    assert len(dot["shape"]) == 2 and not dot.get("lhs_batch"), f"a batched (split-K) dot: {dot}"
    assert TILE in dot["shape"], f"a dot not of one tile of {TILE} rows: {dot}"
  mkn = sorted({_mkn(d) for d in dots})
  assert {m for m, _, _ in mkn} == {TILE}
  vocab = max(max(d["shape"]) for d in dots)  # the lm_head's N
  head = [d for d in dots if vocab in d["shape"]]
  assert len(head) == 1 and head[0]["rhs_contracting"] == (0,), f"the lm_head's dot reads a transposed weight: {head}"
  recorded = h100.recorded("exact/engine/decode_dots", [list(s) for s in mkn])
  assert recorded == [list(s) for s in mkn], f"the exact decode's dots (M, K, N): {mkn}, bounds.json: {recorded}"
  figures.verify()


def test_train_step(figures):
  """The exact padded train step beside the default's: figures, FLOPs, and its forward dots' tiles."""
  name, program = _train(EXACT)
  figures.add(name, program)
  figures.add(*_train(()))
  _check_flops("train", _train(())[1], program)
  dots = _forward_dots(program.text)
  assert dots and all(d["dtype"] == "f32" and TILE in d["shape"] for d in dots), [d["shape"] for d in dots]
  assert "__cudnn$fmha" not in program.text  # the attention is `exact.attention`'s, not cuDNN's
  mkn = sorted({_mkn(d) for d in dots})
  recorded = h100.recorded("exact/train/dots", [list(s) for s in mkn])
  assert recorded == [list(s) for s in mkn], f"the exact step's forward dots (M, K, N): {mkn}, bounds.json: {recorded}"
  assert _has_weight_gradient(_train(())[1].text)  # the default step's weight gradients: the test below is not vacuous
  figures.verify()


def test_train_step_computes_weight_gradients():
  """The exact forward differentiates (`exact.opaque`'s derivative is the identity): the step's
  backward computes the weights' gradients with the plain GEMMs (`exact.dense`'s custom VJP)."""
  assert _has_weight_gradient(_train(EXACT)[1].text), "the exact train step has no weight-gradient GEMM"


def _forward_dots(text: str) -> list[dict]:
  """The dots that read a tile of rows in the compute dtype (`[TILE, K]` bf16): the exact forward's."""
  return [d for d in _dots(text) if d["operands"][0] and d["operands"][0].startswith(f"bf16[{TILE},")]


def test_train_forward_sums_k_as_the_decode_program_does():
  """The exact train step's forward GEMMs are the exact decode program's (M, K, N), each unbatched (K
  in one pass: `exact.COMPILER_OPTIONS` turns XLA's split-K off in both) and none merged with
  another projection's (the tiles' zeros read the weights): the same GEMMs, so the same K order per
  row, as far as the programs show. No dot with a bf16 operand is batched (a split-K GEMM is one;
  the batched dots left are the attention backward's, in fp32)."""
  decode = {_mkn(d) for d in _forward_dots(_decode(EXACT)[1].text)}
  train = _dots(_train(EXACT)[1].text)
  split = [d for d in train if d.get("lhs_batch") and any(o and o.startswith("bf16") for o in d["operands"])]
  assert not split, f"the train step splits K: dots {split}"
  forward = {_mkn(d) for d in _forward_dots(_train(EXACT)[1].text)}
  assert forward == decode, f"the train step's forward dots {sorted(forward)}, the decode's {sorted(decode)}"
