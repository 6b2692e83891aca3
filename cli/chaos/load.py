"""Load for ``lanes chaos``: WebSocket clients that file every frame into one ledger, and the
scoring of each request (completed, cancelled, rejected with a code, or lost; duplicate and
missing token seqs).

The ledger is keyed by request id, not by connection, so a request resumed on another edge
is judged over both connections: every seq exactly once, in order, none missing.
The sim engine's token text is `` tok<position>``, so a completed answer's exact text is
known and checked too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import websockets


@dataclass
class Tracked:
    """Everything the clients saw of one request."""

    id: str
    max_tokens: int
    accepted: bool = False
    #: Every delta seq in arrival order (duplicates included: they are what we count).
    seqs: list[int] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)
    delta_arrivals: list[float] = field(default_factory=list)
    end: dict[str, Any] | None = None
    ended_at: float | None = None
    #: The client left on purpose; the harness then checks Redis that it was cancelled.
    departed: bool = False
    departed_cancelled: bool = False

    def next_seq(self) -> int:
        """The first seq not yet received contiguously (what a resume continues from)."""
        seen = set(self.seqs)
        n = 0
        while n in seen:
            n += 1
        return n


@dataclass
class Tally:
    """Outcome counts of a set of requests."""

    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    duplicates: int = 0
    gaps: int = 0

    def add(self, other: Tally) -> None:
        for name in ("sent", "completed", "cancelled", "lost", "duplicates", "gaps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.rejected.update(other.rejected)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "completed": self.completed, "cancelled": self.cancelled,
                "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected),
                "lost": self.lost, "duplicates": self.duplicates, "gaps": self.gaps}


def sim_text(num_tokens: int) -> str:
    """The exact answer of the sim engine for ``num_tokens`` tokens."""
    return "".join(f" tok{i}" for i in range(num_tokens))


def score(t: Tracked, tally: Tally) -> None:
    """Add one request's outcome to ``tally``."""
    tally.sent += 1
    seen = set(t.seqs)
    tally.duplicates += len(t.seqs) - len(seen)
    holes = (max(seen) + 1 - len(seen)) if seen else 0
    end = t.end
    if end is None:
        if t.departed and t.departed_cancelled:
            tally.cancelled += 1
        else:
            tally.lost += 1
        tally.gaps += holes
    elif end["type"] == "error":
        tally.rejected[end.get("code", "unknown")] += 1
        tally.gaps += holes
    elif end["finish_reason"] == "cancelled":
        tally.cancelled += 1
        tally.gaps += holes
    else:
        num_tokens = int(end["usage"]["completion_tokens"])
        missing = max(num_tokens, max(seen, default=-1) + 1) - len(seen)  # holes and a missing tail
        text = "".join(t.texts[s] for s in sorted(seen))
        tally.gaps += missing if missing or text == sim_text(num_tokens) else 1
        tally.completed += 1


class Ledger:
    """All requests of one fault, filled by any number of connections."""

    def __init__(self) -> None:
        self.requests: dict[str, Tracked] = {}
        #: Frames without a request id (protocol errors): should stay empty.
        self.stray: list[dict[str, Any]] = []

    def __getitem__(self, request_id: str) -> Tracked:
        return self.requests[request_id]

    def on_frame(self, frame: dict[str, Any], at: float) -> None:
        t = self.requests.get(frame.get("id") or "")
        if t is None:
            self.stray.append(frame)
            return
        kind = frame["type"]
        if kind == "accepted":
            t.accepted = True
        elif kind == "delta":
            t.seqs.append(frame["seq"])
            t.texts[frame["seq"]] = frame["text"]
            t.delta_arrivals.append(at)
        elif kind in ("done", "error") and t.end is None:
            t.end, t.ended_at = frame, at

    def tally(self, ids: list[str] | None = None) -> Tally:
        tally = Tally()
        for rid in ids if ids is not None else list(self.requests):
            score(self.requests[rid], tally)
        return tally

    def open_ids(self, ids: list[str]) -> list[str]:
        return [rid for rid in ids if self.requests[rid].end is None and not self.requests[rid].departed]


class LoadClient:
    """One WebSocket connection feeding a ledger."""

    def __init__(self, ws: Any, ledger: Ledger) -> None:
        self.ws = ws
        self.ledger = ledger
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str, ledger: Ledger) -> LoadClient:
        return cls(await websockets.connect(url, max_size=None, open_timeout=10), ledger)

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                self.ledger.on_frame(json.loads(raw), time.monotonic())
        except websockets.ConnectionClosed:
            pass

    async def chat(self, request_id: str, max_tokens: int) -> None:
        self.ledger.requests.setdefault(request_id, Tracked(request_id, max_tokens))
        await self.ws.send(json.dumps({
            "type": "chat", "id": request_id, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"Chaos request {request_id}: tell me about it."}],
        }))

    async def cancel(self, request_id: str) -> None:
        await self.ws.send(json.dumps({"type": "cancel", "id": request_id}))

    async def resume(self, request_id: str) -> None:
        last_seq = self.ledger[request_id].next_seq() - 1
        await self.ws.send(json.dumps({"type": "resume", "id": request_id, "last_seq": last_seq}))

    async def close(self) -> None:
        await self.ws.close()
        self.reader.cancel()


async def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``condition()`` every 20 ms; False when ``timeout_s`` passed first (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True
