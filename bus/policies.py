"""Which policy acts for which agent, and where each policy's trajectories go.

By default every agent shares one policy, "default" (parameter sharing). `--policy-map` on the
broker maps agents to other policies by name pattern (fnmatch, first match wins, unmatched agents
stay on "default"); the broker stamps every experience message with each agent's policy, and the
assembler sends each policy's trajectories to that policy's own endpoint (`--policy-endpoints`),
where that policy's learner (`stepbus trainer --policy-name NAME`) takes them. A Gymnasium env's
single agent has no name: patterns are matched against the empty string, so only `*` catches it.
"""

from __future__ import annotations

import fnmatch
import re

DEFAULT = "default"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # also a directory name in the run directory
MAX_POLICIES = 64


def _pairs(text: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"{what}: {item!r} is not KEY=VALUE")
        pairs.append((key, value))
    return pairs


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(f"policy name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return name


def parse_map(text: str) -> list[tuple[str, str]]:
    """`"adversary_*=red,*=default"` -> [(pattern, policy), ...] in order; ValueError if bad."""
    rules = [(pattern, check_name(policy)) for pattern, policy in _pairs(text, "--policy-map")]
    if len({policy for _, policy in rules} | {DEFAULT}) > MAX_POLICIES:
        raise ValueError(f"--policy-map: at most {MAX_POLICIES} policies")
    return rules


def policy_names(rules: list[tuple[str, str]]) -> list[str]:
    """Every policy a map can choose, "default" first (the fallback is always there)."""
    return list(dict.fromkeys([DEFAULT, *(policy for _, policy in rules)]))


def policy_of(agent: str, rules: list[tuple[str, str]]) -> str:
    for pattern, policy in rules:
        if fnmatch.fnmatchcase(agent, pattern):
            return policy
    return DEFAULT


def parse_endpoints(text: str) -> dict[str, str]:
    """`"red=tcp://127.0.0.1:7350"` -> {"red": "tcp://127.0.0.1:7350"}; ValueError if bad."""
    endpoints: dict[str, str] = {}
    for policy, endpoint in _pairs(text, "--policy-endpoints"):
        if check_name(policy) in endpoints:
            raise ValueError(f"--policy-endpoints: {policy!r} is given twice")
        if policy == DEFAULT:
            raise ValueError("--policy-endpoints: the default policy's endpoint is "
                             "--trajectories")
        endpoints[policy] = endpoint
    if len(endpoints) >= MAX_POLICIES:
        raise ValueError(f"--policy-endpoints: at most {MAX_POLICIES - 1} besides the default")
    return endpoints
