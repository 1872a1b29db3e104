"""The numpy MLP's names where the learner's modules still import them; the MLP itself lives
in `stepbus.models.mlp` and the action space in `stepbus.policy`."""

from __future__ import annotations

from stepbus.models.mlp import (
    WIDE_INPUT,
    Adam,
    act,
    clip_grad_norm,
    for_inference,
    forward,
    hidden_sizes,
    infer_action_space,
    init_params,
    layout,
    log_prob_entropy,
    log_softmax,
    ppo_loss_and_grads,
    value,
)
from stepbus.policy import ActionSpace, Params

__all__ = [
    "WIDE_INPUT", "ActionSpace", "Adam", "Params", "act", "clip_grad_norm", "for_inference",
    "forward", "hidden_sizes", "infer_action_space", "init_params", "layout",
    "log_prob_entropy", "log_softmax", "ppo_loss_and_grads", "value",
]
