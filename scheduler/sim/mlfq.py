"""Skip-join MLFQ (FastServe, Wu et al., arXiv 2305.05920): the baseline that needs no predictor.

Queue ``i`` has a quantum of ``base_quantum_ms * 2**i`` of service. A new job skips the
queues whose quantum is shorter than its first iteration (its prefill, known from the input
length) and joins the first one that fits; each time it uses up a queue's quantum it moves
one queue down. Every iteration the engine runs the highest-priority jobs (lowest queue, then
arrival), preempting the rest at token granularity and swapping their KV cache to host memory.
FastServe also promotes a job that waited too long to the top queue; ``starve_after_s`` models
that, off by default: in this model a promoted job uses up the top quantum in one step, is
demoted and preempted again, and the swapping thrashes (benchmarks/RESULTS.md, issue 9).
Pure: service times are arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MlfqConfig:
    #: Quantum of the top queue (each lower queue doubles it). One full-batch decode step on
    #: L70-H100 is ~50 ms.
    base_quantum_ms: float = 50.0
    num_levels: int = 16
    #: Service a decode step counts for (the engine's full-batch step).
    decode_ms: float = 50.2
    #: A job waiting this long is promoted to the top queue.
    starve_after_s: float = math.inf

    def __post_init__(self) -> None:
        if self.base_quantum_ms <= 0 or self.num_levels < 1 or self.decode_ms <= 0:
            raise ValueError("base_quantum_ms and decode_ms must be > 0, num_levels >= 1")


def first_level(prefill_ms: float, config: MlfqConfig) -> int:
    """The queue a new job joins: the first whose quantum covers its prefill."""
    if prefill_ms <= config.base_quantum_ms:
        return 0
    return min(config.num_levels - 1, math.ceil(math.log2(prefill_ms / config.base_quantum_ms)))


def level(first: int, attained_ms: float, config: MlfqConfig) -> int:
    """The queue of a job that joined ``first`` and has had ``attained_ms`` of service since.

    It leaves queue ``first + c`` once ``attained_ms`` reaches the sum of the quanta of
    ``first .. first + c``, i.e. ``base * 2**first * (2**(c + 1) - 1)``.
    """
    unit = config.base_quantum_ms * 2.0**first
    completed = math.floor(math.log2(max(0.0, attained_ms) / unit + 1.0))
    return min(config.num_levels - 1, first + completed)


def level_end_ms(first: int, current: int, config: MlfqConfig) -> float:
    """Attained service (since joining ``first``) at which a job leaves queue ``current``."""
    if current >= config.num_levels - 1:
        return math.inf
    return config.base_quantum_ms * 2.0**first * (2.0 ** (current - first + 1) - 1.0)
