"""Learning algorithms for `--algo` in tests: small, observable variations of PPO."""

from __future__ import annotations

from stepbus.trainer.ppo import PPO


class NoUpdatePPO(PPO):
    """Publishes new versions without changing the policy: proves `--algo` took effect (its
    updates report `no_update` in metrics.jsonl) while the run goes on."""

    def update(self, batch, tick=None):  # type: ignore[no-untyped-def]
        return {"no_update": 1.0}


class RefusesToStart:
    """Raises when built: a swap to it must be reverted."""

    def __init__(self, *args: object) -> None:
        raise RuntimeError("this algorithm refuses to start")


class CurriculumPPO(PPO):
    """PPO that asks, after its second update, for a reset barrier to level 2 (once)."""

    updates = 0

    def curriculum(self, stats: dict) -> dict | None:
        self.updates += 1
        return {"level": 2} if self.updates == 2 else None
