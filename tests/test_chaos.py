"""The chaos soak's ledger (benchmarks/chaos_ledger.py): its accounting of learned ranges,
its encoding in observations, and its state's round trip through a real checkpoint file.
The soak itself runs by hand (`python benchmarks/chaos.py --minutes 3`), not in the suite."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import chaos_ledger  # noqa: E402

from stepbus.policy import ActionSpace  # noqa: E402
from stepbus.trainer import checkpoint  # noqa: E402
from stepbus.trainer.algorithm import PPOConfig, Trajectory  # noqa: E402


def rows(*ranges: tuple[int, int, int]) -> np.ndarray:
    """Ledger rows from (stream, first, last), times = the step index in ms."""
    return np.array([[s, a, b, a, b] for s, a, b in ranges], np.int64).reshape(-1, 5)


def test_contiguous_ranges_are_learned_once_and_the_rest_is_tail() -> None:
    acc = chaos_ledger.account(rows((7, 0, 9), (7, 10, 19)), {7: 25})
    assert (acc.once, acc.twice, acc.never, acc.tail, acc.produced) == (20, 0, 0, 5, 25)


def test_an_overlap_is_learned_twice_and_a_hole_never() -> None:
    acc = chaos_ledger.account(rows((1, 0, 9), (1, 5, 12), (1, 20, 29)), {1: 30})
    assert acc.twice == 5 and acc.twice_ranges == [(1, 5, 9)]
    assert acc.never == 7
    assert [(h.first, h.last, h.after_ms, h.before_ms) for h in acc.holes] == [(13, 19, 12, 20)]
    assert acc.once == 30 - 7 and acc.tail == 0


def test_a_stream_starting_late_has_a_hole_and_one_never_learned_is_all_tail() -> None:
    acc = chaos_ledger.account(rows((3, 4, 9)), {3: 10, 4: 6})
    assert acc.never == 4 and acc.holes[0].first == 0
    assert acc.tail == 6 and acc.streams == 2 and acc.produced == 16


def test_unsorted_rows_and_a_range_inside_another() -> None:
    acc = chaos_ledger.account(rows((2, 10, 19), (2, 0, 9), (2, 3, 4)))
    assert (acc.once, acc.twice, acc.never, acc.tail) == (20, 2, 0, 0)


def test_ids_travel_exactly_in_float32_observations() -> None:
    values = [0, 1, (1 << 48) - 1, 123_456_789_012, 1_764_000_000_000]
    tags = chaos_ledger.split(values)
    assert tags.dtype == np.float32 and float(tags.max()) < 1.0
    assert chaos_ledger.joined(tags).tolist() == values


def trajectory(env: chaos_ledger.LedgerEnv, obs0: np.ndarray, steps: int
               ) -> tuple[Trajectory, np.ndarray]:
    """`steps` steps of `env` from `obs0` (actions alternating, so the pole stays up), and
    the observation after them."""
    obs = [obs0]
    for i in range(steps):
        obs.append(env.step(i % 2)[0])
    return Trajectory(obs=np.stack(obs[:steps]), actions=np.arange(steps) % 2,
                      logp=np.full(steps, -0.69), values=np.zeros(steps),
                      rewards=np.ones(steps), terminated=False, truncated=False,
                      bootstrap_obs=obs[steps]), obs[steps]


def ledger_ppo(seed: int) -> chaos_ledger.LedgerPPO:
    return chaos_ledger.LedgerPPO(4 + chaos_ledger.COLUMNS, ActionSpace("discrete", n=2),
                                  PPOConfig(n_epochs=1), np.random.default_rng(seed))


def test_the_ledger_algorithm_records_merges_and_survives_a_checkpoint(tmp_path: Path) -> None:
    env = chaos_ledger.LedgerEnv(chaos_ledger.gym.make("CartPole-v1"), str(tmp_path))
    algo = ledger_ppo(0)
    first, obs = trajectory(env, env.reset(seed=0)[0], 5)
    second, obs = trajectory(env, obs, 3)
    algo.update([first, second])
    path = tmp_path / checkpoint.NPZ_FILE
    checkpoint.save(path, algo.params, algo.optimizer_state(), {})
    successor = ledger_ppo(1)
    successor.load_optimizer_state(checkpoint.load(path)[1])
    assert successor.ledger.trajectories == 2
    [[stream, lo, hi, _, _]] = successor.ledger.rows  # the two met end to start: one row
    assert (stream, lo, hi) == (env.stream, 0, 7)
    # The count's time is the observation after the 8th step, the row's the one learned last
    # (after the 7th): the same millisecond, or a later one.
    [(stream, (steps, ms))] = chaos_ledger.produced(tmp_path).items()
    assert (stream, steps) == (env.stream, 8)
    assert 0 <= ms - successor.ledger.rows[0][4] < 1000
    successor.update([trajectory(env, obs, 2)[0]])
    assert successor.ledger.rows[0][2] == 9 and len(successor.ledger.rows) == 1
