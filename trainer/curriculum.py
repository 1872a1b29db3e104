"""Reset barriers a learning algorithm asks for after an update (its `curriculum` hook), as
the learner sends them to the controller one at a time."""

from __future__ import annotations

import logging

from stepbus.bus import protocol as p


class Curriculum:
    """Reset barriers a learning algorithm asks for: sent to the controller, tried again while
    another barrier is running, and the outcome logged. The newest request wins."""

    RETRY_S = 1.0

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.options: dict | None = None  # wanted, not yet sent
        self.asked: dict | None = None  # sent, not yet answered
        self.next_try = 0.0  # the wanted options are not sent before then

    def want(self, options: dict) -> None:
        try:
            p.encode(p.ResetRequest(options=dict(options)))
        except (p.ProtocolError, TypeError, ValueError) as exc:
            self.log.error("curriculum options %r cannot be sent: %s", options, exc)
            return
        self.options, self.next_try = dict(options), 0.0

    def request(self, now: float) -> p.ResetRequest | None:
        """The request to send now, if one is due (one at a time)."""
        if self.options is None or self.asked is not None or now < self.next_try:
            return None
        self.log.info("curriculum: asking for a reset barrier with options %s", self.options)
        self.asked, self.options = self.options, None
        return p.ResetRequest(options=self.asked)

    def answered(self, reply: p.Reply, now: float) -> None:
        asked, self.asked = self.asked, None
        if not reply.ok and "already running" in reply.detail and self.options is None:
            self.options, self.next_try = asked, now + self.RETRY_S  # after that one
            self.log.info("curriculum: a reset barrier is running; asking again in %gs",
                          self.RETRY_S)
            return
        (self.log.info if reply.ok else self.log.warning)("reset barrier: %s", reply.detail)
