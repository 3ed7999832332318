"""The project's command-line scripts. Those that reuse a sibling's code import it as `scripts.<name>` and
run from the repository root as `python -m scripts.<name>` (bench_gpu, bench_lora, bench_decode_layers,
bench_engine_warmup, memory_plan; bench_train with --profile); the rest also run as `python scripts/<name>.py`."""
