"""Many processes: trainer, generator (and reward-model) process groups of one jax.distributed job.

protocol.py           the transfers between the groups, the facts shared through the store
runtime.py            the threads that run them: workers, hand-off slots, the landed weights
The loops of each group are in `llamarl_jax/runners/` (trainer_process.py, generator_process.py,
reward_process.py).
"""
