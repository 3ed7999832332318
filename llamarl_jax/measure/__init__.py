"""Measurement: the step-time model (`perf_model`), the byte and kernel accounting of compiled
programs (`hlo`) and the decode step's cost model (`decode_cost`). Benchmarks, tests and the GPU check
use it; no runtime module imports it (tests/test_imports.py: it is the top layer)."""
