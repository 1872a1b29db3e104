"""Implementations of `stepbus.policy.Policy`."""
