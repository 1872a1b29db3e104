"""stepbus: an RL experience pipeline of decoupled processes on a ZeroMQ bus."""

__version__ = "0.1.0"
