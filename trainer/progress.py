"""What a learner's checkpoint carries besides weights, so a resumed learner continues the
run, and the check that a checkpoint's record of it is one this learner can use."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stepbus.trainer.algorithm import CannotStart

TARGET_MET = "trainer reached"  # how `Progress.solved` starts when the target return ended it


@dataclass
class Progress:
    """What the checkpoint carries besides weights, so a resumed trainer continues the run.
    Its counts are of settled trajectories: learned from (or dropped as stale, or taken in
    once solved); a partial batch is not counted, as the assembler sends it again."""

    version: int = 0
    generation: int = 0
    env_steps: int = 0
    episodes: int = 0
    recent_returns: list[float] = field(default_factory=list)
    updates: int = 0  # over the whole run (every generation), for --max-updates
    assembler: str = ""  # whose numbers `learned` are
    learned: list[int] = field(default_factory=list)  # the newest numbers settled (Receipts.kept)
    # --norm-obs: the statistics of every version still learned from, and the moments to go
    # on from (normalize.Normalizer.to_json); --norm-reward: the discounted return's moments
    obs_norm: list[Any] = field(default_factory=list)
    reward_norm: list[float] = field(default_factory=list)
    # the minibatch generator's state (numpy's bit_generator.state: JSON, no pickle), so a
    # resumed learner draws what the one before it would have drawn next
    rng: dict[str, Any] = field(default_factory=dict)
    # what ended the run, as said then ("" while it goes on), and the goal it met: the target
    # return (0: none) and limits it had; a resume needs a higher one to go on (trainer/resume.py)
    solved: str = ""
    goal: dict[str, float] = field(default_factory=dict)
    # what acting needs besides weights (stepbus.trained.load_policy): the spaces trained on
    # (the SpaceSpec as it travels, protocol.to_map) and the model's name (--model)
    spec: dict[str, Any] = field(default_factory=dict)
    model: str = ""


def progress_of(saved: dict[str, Any], ckpt: Path) -> Progress:
    """A checkpoint's progress record, each field of its own type (a JSON number may be an
    int where a float is meant). Raises CannotStart naming the fields that are not."""
    kinds = {f.name: type(getattr(Progress(), f.name)) for f in dataclasses.fields(Progress)}
    ok = {int: (int,), float: (int, float), str: (str,), list: (list,), dict: (dict,)}
    wrong = sorted(k for k, v in saved.items() if k not in kinds or isinstance(v, bool)
                   or not isinstance(v, ok[kinds[k]]))
    if wrong:
        raise CannotStart(f"checkpoint {ckpt} has a progress record this learner cannot use "
                          f"(fields {wrong[:4]}): start a new run or restore a good copy of it")
    return Progress(**saved)
