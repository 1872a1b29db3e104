"""stepbus: an RL experience pipeline of decoupled processes on a ZeroMQ bus.

`stepbus.load_policy(path)` loads a run's trained policy (`stepbus.trained`); it is imported on
first use, so the processes that never load one do not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepbus.trained import TrainedPolicy as TrainedPolicy
    from stepbus.trained import load_policy as load_policy

__version__ = "0.1.0"
__all__ = ["TrainedPolicy", "__version__", "load_policy"]


def __getattr__(name: str) -> Any:
    if name in ("load_policy", "TrainedPolicy"):
        from stepbus import trained

        return getattr(trained, name)
    raise AttributeError(f"module 'stepbus' has no attribute {name!r}")
