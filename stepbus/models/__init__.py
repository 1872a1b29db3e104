"""Implementations of `stepbus.policy.Policy` (`stepbus.models.base`)."""
