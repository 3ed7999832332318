"""Reward functions that misbehave on purpose, for tests/test_reward_executor.py.

Top-level functions of an importable module (tests/ is on sys.path under pytest), so spawned
reward workers can load them by reference. Each behaves normally (exact match) unless the response
asks for trouble.
"""

import os
import signal
import time


def troublesome(response_text: str, ground_truth: str) -> float:
  """"raise" raises, "hang" sleeps forever, "spin" busy-loops, "exit" calls os._exit, "kill" SIGKILLs
  its own process, "nan" returns NaN, "sleep" takes 0.2 s and scores 1; anything else: 1.0 iff
  response == ground truth."""
  if response_text == "raise":
    raise RuntimeError("reward function failed on purpose")
  if response_text == "hang":
    while True:
      time.sleep(60)
  if response_text == "spin":
    while True:
      pass
  if response_text == "exit":
    os._exit(3)
  if response_text == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
  if response_text == "sleep":
    time.sleep(0.2)
    return 1.0
  if response_text == "nan":
    return float("nan")
  return float(response_text == ground_truth)


def slow_match(response_text: str, ground_truth: str) -> float:
  """Exact match after a short sleep (to exercise the pool's parallelism)."""
  time.sleep(0.05)
  return float(response_text == ground_truth)


_LEAK: list = []


def leaky_match(response_text: str, ground_truth: str) -> float:
  """Exact match that keeps 1 MB per call alive forever (a leaking verifier); "huge" tries to allocate
  1 GB at once."""
  if response_text == "huge":
    _LEAK.append(b"x" * (1 << 30))
  _LEAK.append(b"x" * (1 << 20))  # written, so resident
  return float(response_text == ground_truth)
