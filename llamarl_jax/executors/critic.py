"""The critic executor: a value model trained beside the policy on the trainer's mesh (PPO with a
critic). It holds the critic's `train.critic.CriticState` on its shardings and runs the pure critic
functions of `llamarl_jax.train.critic` on it: `step(arrays, rewards)` gives a batch token-level GAE
advantages from the current critic's values (before this step's updates), then takes
`updates_per_step` optimizer steps towards the returns. The `TrainerExecutor` owns one when
`TrainConfig.critic` is set and calls it before the policy's step.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from llamarl_jax import parallel
from llamarl_jax.config import CriticConfig
from llamarl_jax.model.config import ModelConfig
from llamarl_jax.train import critic as critic_lib
from llamarl_jax.train.placement import init_opt_state, make_placement, place, place_opt_state
from llamarl_jax.train.state import make_optimizer

Array = jax.Array


class CriticExecutor:
  """critic: the settings. policy_config: the policy's model (a critic from the policy is its decoder
  with a zero score head; one from `critic.path` must read the policy's vocabulary). batch_shardings:
  the trainer's batch arrays' shardings. params: the policy's params to start from (None: shapes only,
  or a critic from `critic.path`, loaded unless `abstract`)."""

  def __init__(self, critic: CriticConfig, policy_config: ModelConfig, mesh, *, batch_shardings, microbatches: int,
               attention: str, scan_layers: bool, rules, params=None, abstract: bool = False):
    if critic.path:
      from llamarl_jax.model import hf
      from llamarl_jax.model.llama import split_params

      model_config, model = hf.load_hf_checkpoint(critic.path)
      if model_config.num_labels != 1:
        raise ValueError(f"CriticConfig.path {critic.path}: a critic is a *ForSequenceClassification checkpoint "
                         f"with one label, got {model_config.architecture} with num_labels = {model_config.num_labels}")
      if model_config.vocab_size != policy_config.vocab_size:
        raise ValueError(f"CriticConfig.path {critic.path}: its vocabulary ({model_config.vocab_size}) is not the "
                         f"policy's ({policy_config.vocab_size}); the critic reads the policy's tokens")
      model_config = model_config.replace(dtype=policy_config.dtype)
      initial = None if abstract else split_params(model)[1]
    else:
      model_config = critic_lib.critic_config(policy_config)
      initial = None if abstract else critic_lib.params_from_policy(params)
    self.config, self.mesh, self.from_policy = critic, mesh, not critic.path
    cpl = self.placement = make_placement(model_config, mesh, make_optimizer(critic.optimizer), rules=rules)
    self.repl = cpl.replicated
    self.spec = critic_lib.CriticSpec(model=model_config, critic=critic, microbatches=microbatches,
                                      attention=attention, scan_layers=scan_layers, mesh=mesh,
                                      compute_shardings=cpl.compute)
    self.state = None if initial is None else self.place(initial)
    repl, rows, tokens = self.repl, parallel.batch_sharding(mesh, 1), parallel.batch_sharding(mesh, 2)
    state_sh = critic_lib.CriticState(params=cpl.params, opt_state=cpl.trained.opt_state, updates=repl)
    self.advantages = jax.jit(functools.partial(critic_lib.critic_advantages, self.spec),
                              in_shardings=(cpl.params, batch_shardings, rows), out_shardings=(tokens, tokens, tokens, repl))
    self.update = jax.jit(functools.partial(critic_lib.critic_update, self.spec), donate_argnums=(0,),
                          in_shardings=(state_sh, batch_shardings, tokens, tokens), out_shardings=(state_sh, repl))

  def place(self, params) -> critic_lib.CriticState:
    """A fresh critic state (0 updates, a new optimizer state) of `params` on the critic's shardings."""
    cpl = self.placement
    placed = place(params, jnp.float32, cpl.params, "a critic of the critic's ModelConfig")
    tx = make_optimizer(self.config.optimizer)
    return critic_lib.CriticState(params=placed, opt_state=init_opt_state(cpl, tx, placed),
                                  updates=jax.device_put(jnp.zeros((), jnp.int32), self.repl))

  def policy_loaded(self, params) -> None:
    """The policy became `params`: a critic started from the policy restarts from them (fresh head and
    optimizer state); one from a checkpoint of its own keeps its state."""
    if self.state is not None and self.from_policy:
      self.state = self.place(critic_lib.params_from_policy(params))

  def state_dict(self) -> dict:
    c = self.state
    return {"params": c.params, "opt_state": c.opt_state, "updates": c.updates}

  def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
    if state is None:
      raise ValueError("this trainer has a critic but the state holds none (a checkpoint of a run without "
                       "TrainConfig.critic); resume with the same TrainConfig.critic as the saved run")
    cpl = self.placement
    self.state = critic_lib.CriticState(
        params=place(state["params"], jnp.float32, cpl.params, "a critic of the critic's ModelConfig"),
        opt_state=place_opt_state(cpl, self.state.opt_state, state["opt_state"]),
        updates=jax.device_put(jnp.asarray(state["updates"], jnp.int32), self.repl))

  def step(self, arrays: dict[str, Array], rewards) -> tuple[dict[str, Array], dict]:
    """The critic's values of the batch `arrays` (the current critic: before this step's updates) and
    the rows' `rewards` `[B]` -> GAE advantages `[B, R]` in place of the per-row ones, then
    `updates_per_step` critic updates. Returns the arrays for the policy's step and the critic's
    metrics (the first update's loss: the value loss of rows the critic has not trained on yet)."""
    if rewards is None:
      raise ValueError("a trainer with a critic needs each row's reward (ScoredBatch.rewards), got None; "
                       "score the batch (executors.scoring) before training it")
    rewards = jax.device_put(np.asarray(rewards, np.float32), parallel.batch_sharding(self.mesh, 1))
    advantages, returns, values, metrics = self.advantages(self.state.params, arrays, rewards)
    arrays = {**arrays, "advantages": advantages}
    for i in range(self.config.updates_per_step):
      self.state, update_metrics = self.update(self.state, arrays, values, returns)
      if i == 0:
        metrics = {**metrics, **update_metrics}
      else:
        metrics["critic/vf_loss_last"] = update_metrics["critic/vf_loss"]
    return arrays, metrics
