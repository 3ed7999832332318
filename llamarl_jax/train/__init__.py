"""The trainer as pure functions over a `TrainState` (`step`, `packed`), placed on a mesh (`placement`)
and jitted there with explicit shardings (`programs`)."""

from llamarl_jax.train.layout import LengthGroups, PackPlan, group_by_length, pack_rows, width_bucket
from llamarl_jax.train.packed import packed_train_step
from llamarl_jax.train.state import TrainState, applied_updates, init_state, lr_schedule, make_optimizer
from llamarl_jax.train.step import StepSpec, train_step
