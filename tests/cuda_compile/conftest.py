"""The CUDA compile tier: the GPU programs of the main configurations compiled for an H100 on a machine
without a GPU (`h100.py`). `make test-cuda-compile` installs JAX's CUDA plugin beside the virtualenv and
runs it with LLAMARL_CUDA_COMPILE=1; every other run (`make test`, `make test-slow`, `make test-gpu`)
collects these tests and skips them, saying how to run them. Inside the tier a missing plugin is an
error, not a skip, so a broken install cannot pass as a skipped tier.

Each compiled program's figures go to `figures` (checked against bounds.json, printed as one table at
the end of the session)."""

import os
from pathlib import Path

import pytest

from cuda_compile import h100

HERE = Path(__file__).resolve().parent
SKIP_REASON = (f"the CUDA compile tier runs under `make test-cuda-compile` ({h100.TIER_ENV}=1, with JAX's CUDA "
               "plugin installed beside the virtualenv); this run does not set it")


def pytest_collection_modifyitems(config, items):
  if os.environ.get(h100.TIER_ENV) == "1":
    return
  skip = pytest.mark.skip(reason=SKIP_REASON)
  for item in items:
    if HERE in Path(item.path).resolve().parents:
      item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def h100_target():
  """The H100 compiled for (its topology built once: a missing plugin fails here, naming the install),
  cuDNN's checks answering for its compute capability, and no persistent compilation cache (compile
  seconds are measured; a cache hit would read as a free compile)."""
  import jax

  from llamarl_jax import compat

  try:
    h100.target_devices(1)
  except SystemExit as e:  # bench_generate.target_devices: the error and CUDA_PLUGIN_HELP
    pytest.fail(f"the CUDA compile tier cannot compile for an H100 here: {e}", pytrace=False)
  saved = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  with compat.cudnn_target_compute_capability(h100.TARGET_CAPABILITY):
    yield
  jax.config.update("jax_enable_compilation_cache", saved)


class FigureCheck:
  """Collects the figures of one test's compiled programs; `verify()` fails the test on any figure
  outside bounds.json's band (with LLAMARL_RECORD_BOUNDS=1 it writes them there instead)."""

  def __init__(self, record_property):
    self._record, self._bounds, self.problems = record_property, h100.read_bounds(), []

  def add(self, name: str, program: "h100.Program") -> "h100.Program":
    """Record `program`'s figures as `name`'s; returns the program."""
    row = program.figures.row()
    self._record("h100", [name, row])
    if h100.recording():
      h100.record_bounds(name, row)
    else:
      self.problems += [f"{name}: {p}" for p in h100.out_of_bounds(name, program.figures, self._bounds)]
    return program

  def verify(self) -> None:
    assert not self.problems, "figures outside bounds.json:\n  " + "\n  ".join(self.problems)


@pytest.fixture
def figures(record_property):
  return FigureCheck(record_property)


_ROWS: list = []


def pytest_runtest_logreport(report):
  if report.when == "call":
    _ROWS.extend(value for key, value in report.user_properties if key == "h100")


def pytest_terminal_summary(terminalreporter):
  if not _ROWS:
    return
  gb = lambda n: f"{n / 1e9:.3f}"
  write = terminalreporter.write_line
  write(f"\nprograms compiled for an H100 (no GPU attached; {h100.versions()}); bytes in GB per device:")
  write(f"{'program':<44} {'compile s':>9} {'kernels':>8} {'GEMMs':>6} {'moved':>9} {'arguments':>9} "
        f"{'outputs':>8} {'temps':>8}")
  for name, row in sorted(_ROWS, key=lambda r: r[0]):  # a program may be recorded by two tests
    write(f"{name:<44} {row['compile_s']:>9.1f} {row['kernels']:>8} {row['gemms']:>6} {gb(row['bytes']):>9} "
          f"{gb(row['argument_bytes']):>9} {gb(row['output_bytes']):>8} {gb(row['temp_bytes']):>8}")
  write(f"{len(_ROWS)} programs, {sum(r['compile_s'] for _, r in _ROWS):.0f} s of XLA compiles")
