"""`LiveResource`: the base of objects that hold processes, threads or devices (a reward worker pool).

Never a setting: a config field holding one is refused (`config.RewardConfig.fn`). A leaf module that
imports nothing, so the executors subclass it and the config checks for it without importing either
the other (a reward worker process imports the reward executor's module: it stays free of JAX).
"""


class LiveResource:
  """Base of the objects that hold processes, threads or devices: never a configuration value."""
