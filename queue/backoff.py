"""One retry policy for every loop that talks to Redis: capped exponential backoff with jitter,
and one log line per outage instead of one per attempt.

A loop calls ``failed(exc)`` after an error and sleeps what it returns, and ``succeeded()``
after a success; the first failure of an outage logs a warning, repeats are counted, and the
recovery logs how long the outage lasted and how many attempts it took.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Retry delays for one loop: ``min_s``, doubling up to ``max_s``, with +-``jitter`` share."""

    #: What the log lines call the loop ("token channel", "claim loop", ...).
    name: str
    log: logging.Logger
    min_s: float = 0.05
    max_s: float = 2.0
    jitter: float = 0.2
    _delay_s: float = field(default=0.0, init=False)
    _failures: int = field(default=0, init=False)
    _since: float = field(default=0.0, init=False)

    def failed(self, exc: BaseException, detail: str = "") -> float:
        """Record a failure; returns how long to wait before the next attempt (s). ``detail``
        ends the outage's warning (what waits on it, as the edge's "3 pending (ids)")."""
        if self._failures == 0:
            self._since = time.monotonic()
            self._delay_s = self.min_s
            self.log.warning("%s: %s; retrying with backoff (up to %.1f s)%s", self.name, _describe(exc), self.max_s,
                             f": {detail}" if detail else "")
        else:
            self._delay_s = min(self._delay_s * 2, self.max_s)
        self._failures += 1
        return self._delay_s * (1 + self.jitter * (2 * random.random() - 1))

    def succeeded(self, detail: str = "") -> None:
        """Record a success; ends an outage (one info line, ended by ``detail`` if given)."""
        if self._failures:
            self.log.info("%s: recovered after %.1f s (%d failed attempts)%s", self.name,
                          time.monotonic() - self._since, self._failures, f": {detail}" if detail else "")
            self._failures = 0

    @property
    def failing(self) -> bool:
        """In an outage: the last attempt failed."""
        return self._failures > 0


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
