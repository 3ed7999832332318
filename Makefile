# The two README commands: `make run` (set up + main job) and `make test` (set up + test suite).
# PY: the Python to build the virtualenv from (3.10-3.13); another than the default `python3` gets its own
# virtualenv, .venv-<version> (e.g. `make test PY=python3.12` -> .venv-3.12), so stacks sit side by side.
PY ?= python3
PYVER := $(shell $(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifeq ($(PYVER),)
$(error PY=$(PY) does not run here: name a Python 3.10-3.13 interpreter that does, e.g. PY=$$(pyenv prefix 3.12.1)/bin/python3.12)
endif
VENV ?= $(if $(filter python3,$(PY)),.venv,.venv-$(PYVER))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# XLA's flags come from llamarl_jax/compat.py, chosen from the flags this jaxlib's XLA defines (an unknown
# flag aborts XLA): `python -m llamarl_jax.compat [options] -- command` runs the command with them.
# Tests: 8 fake CPU devices so mesh tests (fsdp, tp, disjoint trainer/generator meshes) run without a GPU,
# and `--compile fast`: the tests compile far more than they run; where this XLA has the switch, its legacy
# CPU emitters (about twice as fast to compile as the fusion emitters), and LLVM at -O1 (XLA's default: -O3;
# tests/test_trainer.py alone: 172 s -> 110 s). XLA_ARGS adds options to every command's, e.g.
# `make run XLA_ARGS="--fusion_emitters on"` (`python -m llamarl_jax.compat --help`).
XLA_ARGS ?=
XLA_ENV = JAX_PLATFORMS=cpu $(BIN)/python -m llamarl_jax.compat $(XLA_ARGS)
TEST_ENV = $(XLA_ENV) --cpu_devices 8 --compile fast --
# make run's: 4 fake CPU devices (trainer FSDP over 2, generator data-parallel over 2).
RUN_ENV = $(XLA_ENV) --cpu_devices 4 --
# Two pytest workers (pytest-xdist), one test file to a worker at a time (`--dist loadfile`: a module's
# fixtures run once); they share tests/conftest.py's compilation cache. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
TEST_PAR = -n $(TEST_WORKERS) --dist loadfile

.PHONY: install install-gpu install-cuda-compile run run-fp8 run-rm run-gpu test test-slow test-all test-cost test-gpu test-cuda-compile bench bench-gpu gpu-check study study-offpolicy clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# On a CUDA machine: JAX's CUDA 12 wheels beside the test extras.
install-gpu: install
	$(BIN)/python -m pip install -q -e '.[test,cuda12]'

run: install
	$(RUN_ENV) $(BIN)/python scripts/train.py --gin_file=configs/tiny_cpu.gin --run_dir=runs/tiny_cpu_$$(date +%Y%m%d_%H%M%S) $(ARGS)

# `make run` with the generator in fp8 and the token-level masked importance-sampling loss (configs/tiny_cpu_fp8.gin).
run-fp8: install
	$(RUN_ENV) $(BIN)/python scripts/train.py --gin_file=configs/tiny_cpu_fp8.gin --run_dir=runs/tiny_cpu_fp8_$$(date +%Y%m%d_%H%M%S) $(ARGS)

# `make run` with a trained reward model as the only reward (configs/tiny_rm.gin, README "Reward models"):
# make run's SFT warm start (exported), preference pairs of the task, a Bradley-Terry reward model trained
# from the warm-started policy, then make run's RL rewarded by that model alone; all under RM_RUN.
RM_RUN := runs/tiny_rm_$(shell date +%Y%m%d_%H%M%S)
run-rm: install
	$(RUN_ENV) $(BIN)/python scripts/train.py --gin_file=configs/tiny_cpu.gin --run_dir=$(RM_RUN)/sft \
	  --gin_param=run_experiment.rl_steps=0 --gin_param=run_experiment.eval_size=0 \
	  --gin_param=run_experiment.export_sft=True --gin_param=run_experiment.export=False
	$(BIN)/python scripts/preference_pairs.py --out $(RM_RUN)/pairs --train 4000 --heldout 500
	$(RUN_ENV) $(BIN)/python scripts/train_rm.py --pairs $(RM_RUN)/pairs/train.jsonl \
	  --heldout_pairs $(RM_RUN)/pairs/heldout.jsonl --init $(RM_RUN)/sft/sft_export --run_dir $(RM_RUN)/rm \
	  --steps 400 --lr 3e-4
	$(RUN_ENV) $(BIN)/python scripts/train.py --gin_file=configs/tiny_rm.gin --run_dir=$(RM_RUN)/rl \
	  --gin_param="build_policy.model_path='$(RM_RUN)/sft/sft_export'" \
	  --gin_param="RewardConfig.model_path='$(RM_RUN)/rm/hf_export'" $(ARGS)

# The suite without the tests marked `slow`: every module's unit and parity tests, on two workers, about
# 8 minutes on 2 cores. The `slow` tests (more than ~15 s each on 2 idle cores: whole runs in fresh
# interpreters, multi-process jobs, kill-and-resume, learning tests, benchmark scripts' dry runs, the
# heaviest parity sweeps) are `make test-slow`; CI (.ci/run) runs both.
test: install
	@$(BIN)/python -c 'import sys, jax; print(f"python {sys.version.split()[0]}, jax {jax.__version__} ($(VENV))")'
	$(TEST_ENV) $(BIN)/python -m pytest -q $(TEST_PAR) -m "not slow" $(ARGS)

test-slow: install
	$(TEST_ENV) $(BIN)/python -m pytest -q $(TEST_PAR) -m slow $(ARGS)

# Everything in one pytest session (one compilation cache for both tiers).
test-all: install
	$(TEST_ENV) $(BIN)/python -m pytest -q $(TEST_PAR) $(ARGS)

# Each test's CPU seconds (tests/conftest.py, LLAMARL_TEST_CPU_LOG), which a busy machine changes much
# less than wall time: the 25 costliest and the total per tier. ARGS picks the tests (e.g. ARGS='-m "not slow"').
test-cost: install
	rm -f test_cpu.log
	LLAMARL_TEST_CPU_LOG=test_cpu.log $(TEST_ENV) $(BIN)/python -m pytest -q $(TEST_PAR) $(ARGS)
	sort -rn test_cpu.log | head -25
	awk '{s += $$1} END {printf "%d tests, %.0f CPU-seconds\n", NR, s}' test_cpu.log

# The suite on the GPU: tests whose meshes need more devices than present skip, saying so; tests/gpu/ run.
# No preallocation: the multi-process tests start several interpreters on the one GPU.
test-gpu: install-gpu
	JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false $(BIN)/python -m pytest -q $(ARGS)

# The GPU programs of the main configurations compiled for an H100 on this machine, no GPU attached
# (tests/cuda_compile/; shared/GPU.md "Checking GPU programs without a GPU"): a lowering or compile error
# fails, and so does a program whose kernels, bytes or memory leave tests/cuda_compile/bounds.json's band
# (LLAMARL_RECORD_BOUNDS=1 records new figures). JAX's CUDA plugin matching this jaxlib, ptxas
# (nvidia-cuda-nvcc) and cuDNN (its attention's lowering needs the library) go into CUDA_SITE with
# --no-deps, beside the virtualenv, which stays CPU-only: 0.9 GB of wheels (pip's cache serves a reinstall),
# 1.7 GB installed, once (the stamp). LLAMARL_CUDA_COMPILE=1 runs the tier; `make test` skips it.
CUDA_SITE ?= $(if $(filter python3,$(PY)),.cuda-site,.cuda-site-$(PYVER))
CUDA_STAMP := $(CUDA_SITE)/.installed-stamp
CUDA_ENV = LLAMARL_CUDA_COMPILE=1 JAX_PLATFORMS=cpu,cuda JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=$(abspath $(CUDA_SITE)) \
  PATH=$(abspath $(CUDA_SITE))/nvidia/cuda_nvcc/bin:$$PATH $(BIN)/python -m llamarl_jax.compat $(XLA_ARGS) --

$(CUDA_STAMP): $(STAMP)
	rm -rf $(CUDA_SITE)
	v=$$($(BIN)/python -c 'import jaxlib; print(jaxlib.__version__)') && \
	  $(BIN)/python -m pip install -q --no-deps --target $(CUDA_SITE) "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" \
	    nvidia-cuda-nvcc-cu12 "nvidia-cudnn-cu12>=9.8"
	touch $(CUDA_STAMP)

install-cuda-compile: $(CUDA_STAMP)

test-cuda-compile: install-cuda-compile
	$(CUDA_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist load tests/cuda_compile $(ARGS)

# One GPU at Llama-3.2-1B shapes from random weights (configs/llama3_1b_1gpu.gin, no download): the memory
# plan, 8 RL steps of 64 rows x 1536 tokens (colocated, slot engine, bf16 generator), then where the time went
# (also in the run directory's summary.json).
run-gpu: install-gpu
	$(BIN)/python scripts/train.py --gin_file=configs/llama3_1b_1gpu.gin --run_dir=runs/llama3_1b_1gpu_$$(date +%Y%m%d_%H%M%S) $(ARGS)

# One command for the GPU numbers: results/bench_gpu/bench_gpu.{md,json} (written after each section). Measured
# on one H200 (shared/GPU.md, BENCHMARKS.md): the trainer, PyTorch-peer, decode and transformers sections in one
# call, the engine and profile sections in another; the whole command has not run end to end on a GPU. The JSON
# calibrates the step-time model: python -m llamarl_jax.measure.perf_model --calibrate results/bench_gpu/bench_gpu.json
bench-gpu: install-gpu
	$(BIN)/python -m scripts.bench_gpu --out results/bench_gpu $(ARGS)

# Every GPU-only path against a reference on one GPU, within 8 minutes (scripts/gpu_check.py): one line
# per section (pass / FAIL / figure), results/gpu_check/gpu_check.{json,md} written after each section.
# ARGS=--dry_run: every section at toy sizes on the CPU (CI), without the CUDA wheels.
GPU_CHECK_DRY = $(findstring --dry_run,$(ARGS))
gpu-check: $(if $(GPU_CHECK_DRY),install,install-gpu)
	$(if $(GPU_CHECK_DRY),$(XLA_ENV) --,) $(BIN)/python -m scripts.gpu_check --out results/gpu_check $(ARGS)

bench: install
	$(TEST_ENV) $(BIN)/python scripts/bench_generate.py
	$(TEST_ENV) $(BIN)/python scripts/bench_train.py
	$(TEST_ENV) $(BIN)/python scripts/bench_weight_sync.py
	$(TEST_ENV) $(BIN)/python scripts/bench_async.py
	JAX_PLATFORMS=cpu $(BIN)/python scripts/bench_multiprocess.py
	$(BIN)/python scripts/bench_verify.py
	$(BIN)/python -m llamarl_jax.measure.perf_model

# The learning-quality study (scripts/study.py, BENCHMARKS.md): 8 cells x 5 seeds from one shared SFT
# checkpoint; resumable (finished runs under runs/study are skipped). Plots need the [study] extra.
study: install
	$(BIN)/python -m pip install -q -e '.[study]'
	$(XLA_ENV) --cpu_devices 2 -- $(BIN)/python scripts/study.py --gin_file=configs/study.gin --out runs/study --seeds 5 $(ARGS)

study-offpolicy: install  # the off-policy objectives' grid: 20 cells x 5 seeds, ~2 h on 2 cores
	$(BIN)/python -m pip install -q -e '.[study]'
	$(XLA_ENV) --cpu_devices 2 -- $(BIN)/python scripts/study.py --gin_file=configs/study.gin --out runs/study_offpolicy --seeds 5 --cells offpolicy $(ARGS)

clean:
	rm -rf $(VENV) runs results .pytest_cache
