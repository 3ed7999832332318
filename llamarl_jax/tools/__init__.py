"""Tools an episode can call: a sandboxed Python interpreter."""

from llamarl_jax.tools.sandbox import (STATUSES, SandboxCapabilities, SandboxLimits, SandboxPool, ToolResult,
                                       capabilities, run_python)

__all__ = ["STATUSES", "SandboxCapabilities", "SandboxLimits", "SandboxPool", "ToolResult", "capabilities",
           "run_python"]
