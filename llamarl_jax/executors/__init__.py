"""Executors: generator, reward, trainer, weight sync.

Keep this file free of imports: reward worker processes import `llamarl_jax.executors.reward`, and
everything imported here would be imported (JAX included) in every worker.
"""
