"""Many processes: trainer and generator as separate process groups of one jax.distributed job.

protocol.py           the order of cross-process transfers, the facts shared through the store
trainer_process.py    `Controller.run` in a trainer process
generator_process.py  `Controller.run` in a generator process
"""
