"""Free TCP ports for a job's processes on one machine (no jax import: the local launcher uses it)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
  """The kernel's range for outgoing connections' source ports (Linux; else the IANA default)."""
  try:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return low, high
  except (OSError, ValueError):
    return 49152, 65535


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
  """n distinct free ports (all bound at once, then released), drawn below the ephemeral range.

  A port from `bind(0)` lies in the ephemeral range, where any process's outgoing connection (a gRPC
  client of another job, say) can take it as its source port between our release and the child's
  bind ("Address already in use"); ports below that range are only ever taken by an explicit bind.
  """
  low = max(1024, min(_ephemeral_range()[0], 65536) - 12288)
  candidates = random.Random().sample(range(low, low + 12288), k=min(12288, 64 * n))
  socks = []
  try:
    for port in candidates:
      if len(socks) == n:
        break
      s = socket.socket()
      try:
        s.bind((host, port))
      except OSError:  # taken: try the next
        s.close()
        continue
      socks.append(s)
    while len(socks) < n:  # every candidate taken: whatever the kernel gives
      s = socket.socket()
      s.bind((host, 0))
      socks.append(s)
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()
