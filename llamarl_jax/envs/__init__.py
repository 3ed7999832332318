"""Episodes: the `Environment` protocol, single-turn and tool-calling environments, and the one
rollout path `run_episodes` that turns prompts into a trainable batch."""

from llamarl_jax.envs.base import Environment, SingleTurn, ToolCall, Transition
from llamarl_jax.envs.episodes import Episodes, run_episodes, turn_seed
from llamarl_jax.envs.tools_env import TOOL_SCHEMAS, PythonTool, ToolEnvironment, calc, make_environment

__all__ = ["TOOL_SCHEMAS", "Environment", "Episodes", "PythonTool", "SingleTurn", "ToolCall", "ToolEnvironment", "Transition", "calc",
           "make_environment", "run_episodes", "turn_seed"]
