"""The learner's record of trajectories taken in: a trajectory sent again is not taken twice,
and the record stays the same size however long the run (flat RSS)."""

from __future__ import annotations

import contextlib
import time
import tracemalloc

import zmq
from conftest import Cluster, wait_for
from controller_probe import shutdown, status_rows

from stepbus.trainer import receipts
from stepbus.trainer.receipts import LEARNED_KEPT, Receipts


def cycle(r: Receipts, seqs: range, assembler: str = "a1") -> None:
    """Take each in, learn from it, checkpoint and have the receipt delivered, in batches of
    64."""
    batch: list[int] = []
    for seq in seqs:
        assert r.take(assembler, seq)
        batch.append(seq)
        if len(batch) == 64:
            r.learn((assembler, s) for s in batch)
            r.checkpointed()
            assert r.message("t", "i", "default", 0.0) is not None
            r.delivered()
            batch.clear()


def test_a_number_taken_in_is_refused_while_in_a_batch_and_long_after_it_was_learned() -> None:
    r = Receipts()
    # One counter across policies: this learner's numbers have gaps (another's are odd).
    cycle(r, range(0, 2 * 64 * 100, 2))
    assert not r.take("a1", 0) and not r.take("a1", 2 * 64 * 100 - 2), "learned, receipted"
    receipt = r.message("t", "i", "default", 0.0)
    assert receipt is not None and receipt.learned.tolist() == [0, 2 * 64 * 100 - 2], (
        "and receipted again: the assembler that sent them again may have missed it")
    r.delivered()
    assert r.take("a1", 20_000) and not r.take("a1", 20_000), "taken in, in a batch"
    r.learn([("a1", 20_000)])
    assert not r.take("a1", 20_000), "learned, not yet checkpointed"
    r.checkpointed()
    receipt = r.message("t", "i", "default", 0.0)
    assert receipt is not None and receipt.learned.tolist() == [20_000]
    assert not r.take("a1", 20_000), "learned, receipt not yet delivered"
    r.delivered()
    assert not r.take("a1", 20_000), "learned and receipted"
    assert r.take("a1", 1), "another policy's number below ours: never taken in here"
    assert r.take("a2", 0), "a new assembler numbers afresh"


def test_the_record_stays_the_same_size_however_many_trajectories_go_through() -> None:
    """The old record kept 200k numbers in a set (16 MiB, growing for minutes)."""
    r = Receipts()
    cycle(r, range(0, 2 * LEARNED_KEPT, 2))  # the ring has been round once
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        cycle(r, range(2 * LEARNED_KEPT, 10 * LEARNED_KEPT, 2))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename")
                if s.traceback[0].filename == receipts.__file__)
    assert grown < 64 << 10, f"the record grew {grown} bytes over {4 * LEARNED_KEPT} numbers"
    assert len(r.open) == 0 and r.recent.shape == (LEARNED_KEPT,)
    assert not r.take("a1", 10 * LEARNED_KEPT - 2), "the newest are still refused"


def row(cluster: Cluster, role: str) -> dict:
    rows = [r for r in status_rows(cluster) if r["role"] == role]
    return rows[0] if rows else {}


def test_what_the_assembler_sends_again_to_a_learner_that_has_it_is_not_taken_twice(
        cluster: Cluster):
    """A second consumer connecting to the trajectories endpoint makes the assembler send
    everything unlearned again: the learner, whose batch never fills, has all of it already."""
    procs = cluster.start_all(trainer="learner",
                              trainer_args=("--target-return", "0", "--batch-steps", "1000000"))
    wait_for(lambda: row(cluster, "trainer").get("trajectories", 0) >= 50, 60,
             "the learner to take trajectories in")
    # Each connection makes the assembler send everything unlearned again, spread over the
    # learner and this socket (which never reads) message by message: try until some reached
    # the learner.
    learner_figures: dict = {}
    for _ in range(10):
        other = cluster.socket(zmq.PULL, cluster.endpoints["trajectories"])
        try:
            with contextlib.suppress(AssertionError):
                learner_figures = wait_for(
                    lambda: (r := row(cluster, "trainer")).get("duplicates") and r, 5,
                    "the learner to refuse what it has already")
            # the assembler's count of what it sent again, on its next heartbeat
            assembler = wait_for(lambda: (r := row(cluster, "assembler")).get("resent") and r,
                                 5, "the assembler's figures to show what it sent again")
        finally:
            other.close()
        if learner_figures:
            break
    assert learner_figures, "no trajectory sent again reached the learner, or it took them"
    assert assembler["resent"] > 0
    # The assembler's figures from a heartbeat it sent after the learner's figures were read:
    # it keeps making trajectories, so an older heartbeat may count fewer than the learner's.
    read = time.monotonic()
    assembler = wait_for(lambda: (r := row(cluster, "assembler")) and time.monotonic()
                         - r["last_heartbeat_s"] > read + 0.05 and r, 5,
                         "an assembler heartbeat from after the learner's figures")
    assert learner_figures["trajectories"] <= assembler["trajectories"], (
        "the learner took in more than the assembler ever made", learner_figures, assembler)
    assert shutdown(cluster)
    codes = {name: proc.wait(30) for name, proc in procs.items()}
    assert codes == dict.fromkeys(procs, 0), cluster.dump()
