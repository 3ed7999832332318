"""JAX's persistent compilation cache: compiled programs (and XLA's GPU autotuning results) kept on
disk, so a second process of the same configuration loads its programs instead of compiling them.

On by default for programs compiled for a GPU (`enable_persistent_cache`, called by the slot engine
and `scripts/train.py`), in `$LLAMARL_JAX_CACHE_DIR` (default `~/.cache/llamarl_jax/jax`); an empty
`LLAMARL_JAX_CACHE_DIR` turns it off. A directory set through JAX itself (`JAX_COMPILATION_CACHE_DIR`
or `jax.config.update("jax_compilation_cache_dir", ...)`) is kept as it is. CPU programs compile in
a fraction of a second at the sizes run there: the cache stays off for them unless asked for.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

CACHE_DIR_ENV = "LLAMARL_JAX_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/llamarl_jax/jax"
CACHED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def enable_persistent_cache(platform: str | None = None, directory: str | os.PathLike | None = None) -> str | None:
  """Turn JAX's persistent compilation cache on for programs compiled for `platform` (default: the
  default backend's); returns the directory in use, or None when the cache stays off.

  directory: where (default `$LLAMARL_JAX_CACHE_DIR`, else `~/.cache/llamarl_jax/jax`); given, the
  cache is turned on whatever the platform. XLA's per-fusion autotuning cache lives beside the
  programs (`jax_persistent_cache_enable_xla_caches`, JAX's default), so a warm start skips the GPU's
  autotuning too.
  """
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if directory is None:
    env = os.environ.get(CACHE_DIR_ENV)
    if env == "":
      return None
    if (platform or jax.default_backend()) not in CACHED_PLATFORMS:
      return None
    directory = env or DEFAULT_CACHE_DIR
  path = os.path.abspath(os.path.expanduser(os.fspath(directory)))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  compilation_cache.reset_cache()  # JAX decides once per process whether to use it: decide again
  return path
