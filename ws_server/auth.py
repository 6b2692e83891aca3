"""API keys, checked once per WebSocket handshake, and the browser Origin allowlist.

Keys are 256-bit random strings (``lanes_`` + 43 url-safe characters), so we store only
their SHA-256: with that much entropy no dictionary or brute force can invert the hash, and a
slow KDF (scrypt, argon2) would only add tens of ms and a CPU-exhaustion lever to every
handshake while buying nothing. A lookup is one ``GET lanes:keys:<sha256 hex>``; the
attacker cannot steer which bytes of a SHA-256 a probe matches, so it leaks nothing useful
through timing either.

The key travels only in ``Authorization: Bearer <key>``. A ``?api_key=`` query parameter is
refused on purpose: URLs land in proxy and access logs, browser history and ``Referer``
headers.

**Browsers** cannot set headers on ``new WebSocket()``, so a page exchanges its key for a
*ticket*: ``POST /v1/ws-ticket`` with ``Authorization: Bearer <key>`` returns 256 random bits
that stand for that key for ``LANES_WS_TICKET_TTL_S`` (10 s) and **one** handshake
(``/v1/chat?ticket=...``). Redis holds only the ticket's SHA-256 (``lanes:ticket:<sha256>`` ->
the key's hash, with a TTL) and the handshake takes it with ``GETDEL``, so a ticket that
reaches a log, a history or a proxy is already spent or about to expire, and two racing
handshakes cannot both use it. The key is looked up again when the ticket is redeemed: a key
revoked in between does not get in. A reconnect asks for a new ticket. The ticket POST itself
cannot be made from another site's page (a cross-origin request with ``Authorization`` needs
a CORS preflight, which this edge grants only to the Origin allowlist's origins) and obeys that
allowlist.

Handshake refusals (HTTP status, ``lanes_errors_total{code}``)::

    401 unauthorized     no key, malformed ``Authorization``, unknown or revoked key;
                         a ticket that is unknown, used, expired or forged
    403 forbidden_origin a browser ``Origin`` not in ``LANES_ALLOWED_ORIGINS``
    503 auth_unavailable Redis (the key store) did not answer
"""

from __future__ import annotations

import contextlib

import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qs

import msgspec
from lanes.queue.errors import QueueUnavailable
from lanes.queue.plane import QueuePlane
from lanes.telemetry import metrics
from lanes.ws_server.ratelimit import UNLIMITED, KeyLimits
from lanes.ws_server.settings import EdgeSettings

log = logging.getLogger(__name__)

KEY_PREFIX = "lanes_"
#: Longer bearer tokens are refused before hashing (ours are 49 characters).
MAX_KEY_CHARS = 256
#: Paths that need a key when auth is on, unless ``protect_metrics`` is false.
METRICS_PATHS = frozenset({"/metrics", "/v1/depths", "/v1/workers", "/v1/stats/history", "/v1/stats/stream"})
#: Longer ``?ticket=`` values are refused before hashing (ours are 43 characters).
MAX_TICKET_CHARS = 128


def generate_key() -> str:
    """A new API key with 256 bits of entropy; the prefix lets secret scanners spot leaks."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """SHA-256 hex digest: what ``lanes:keys:<hash>`` and ``LANES_API_KEY_HASHES`` hold."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(key_hash: str) -> str:
    """The id a key is counted and scoped by (``Identity.key_id``): a prefix of its hash."""
    return key_hash[:16]


def parse_csv(text: str, *, lower: bool = False) -> frozenset[str]:
    """A comma list from a setting, blanks dropped (``"a, b,"`` -> {a, b})."""
    items = (item.strip().rstrip("/") if lower else item.strip() for item in text.split(","))
    return frozenset(item.lower() if lower else item for item in items if item)


class HeaderLookup(Protocol):
    """Request headers, case-insensitive (Starlette's ``Headers``)."""

    def get(self, key: str, default: str | None = None) -> str | None: ...

    def getlist(self, key: str) -> Sequence[str]: ...


def bearer_token(headers: HeaderLookup) -> str | None:
    """The key from exactly one ``Authorization: Bearer <key>`` header, else None."""
    values = headers.getlist("Authorization")
    if len(values) != 1:
        return None
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or " " in token or len(token) > MAX_KEY_CHARS:
        return None
    return token


def ticket_param(query_string: bytes) -> str | None:
    """The ``ticket`` of a handshake's query string; None without one, "" (refused) when given
    more than once."""
    values = parse_qs(query_string.decode("latin-1"), keep_blank_values=True).get("ticket")
    if values is None:
        return None
    return values[0] if len(values) == 1 else ""


def origin_allowed(origin: str | None, allowed: frozenset[str]) -> bool:
    """Browsers always send ``Origin`` on a WebSocket handshake; other clients usually don't.

    An empty allowlist allows everything; a missing Origin (not a browser) is allowed, since
    Origin defends against cross-site WebSocket hijacking, which needs a browser.
    """
    if not allowed or origin is None:
        return True
    return origin.strip().rstrip("/").lower() in allowed


class KeyRecord(msgspec.Struct, frozen=True):
    """What ``lanes:keys:<hash>`` holds (JSON). A None limit means the edge's default."""

    name: str
    created_at_s: float
    rate_per_s: float | None = None
    burst: int | None = None
    max_in_flight: int | None = None
    max_connections: int | None = None
    #: The first characters of the key (``lanes_Ab3x``) so people can tell keys apart.
    hint: str = ""


def encode_record(record: KeyRecord) -> bytes:
    return msgspec.json.encode(record)


def decode_record(raw: bytes) -> KeyRecord:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on a malformed record."""
    return msgspec.json.decode(raw, type=KeyRecord)


def new_record(name: str, key: str, rate_per_s: float | None, burst: int | None,
               max_in_flight: int | None, now_s: float | None = None,
               max_connections: int | None = None) -> KeyRecord:
    return KeyRecord(name=name, created_at_s=time.time() if now_s is None else now_s, rate_per_s=rate_per_s,
                     burst=burst, max_in_flight=max_in_flight, max_connections=max_connections,
                     hint=key[: len(KEY_PREFIX) + 4])


@dataclass(frozen=True)
class Identity:
    """Who a connection authenticated as."""

    #: Rate-limit and in-flight accounting id (a prefix of the key's hash; never the key).
    key_id: str
    #: Human name from ``lanes keys create NAME`` (for logs and metrics).
    name: str
    limits: KeyLimits
    #: The key's SHA-256 when it lives in Redis (where it can be revoked); "" for static keys.
    key_hash: str = ""


#: Every connection when auth is off: no per-key limits (the per-connection cap still holds).
ANONYMOUS = Identity(key_id="", name="anonymous", limits=UNLIMITED)


def limits_for(record: KeyRecord | None, settings: EdgeSettings) -> KeyLimits:
    """The record's own limits, falling back to the edge's ``key_*`` defaults."""
    rate = record.rate_per_s if record and record.rate_per_s is not None else settings.key_rate_per_s
    burst = record.burst if record and record.burst is not None else settings.key_burst
    cap = record.max_in_flight if record and record.max_in_flight is not None else settings.key_max_in_flight
    conns = record.max_connections if record and record.max_connections is not None \
        else settings.key_max_connections
    return KeyLimits(rate_per_s=float(rate), burst=int(burst), max_in_flight=int(cap), max_connections=int(conns))


@dataclass(frozen=True)
class Refusal:
    """A request or handshake refused before it reaches the edge; the shell renders it (HTTP
    status, or the WebSocket handshake's denial response)."""

    status: HTTPStatus
    code: str
    message: str

    def headers(self) -> dict[str, str]:
        extra = {"WWW-Authenticate": 'Bearer realm="lanes"'} if self.status is HTTPStatus.UNAUTHORIZED \
            else {"Retry-After": "1"} if self.status is HTTPStatus.TOO_MANY_REQUESTS else {}
        return {"Cache-Control": "no-store", **extra}


def _refusal(status: HTTPStatus, code: str, text: str) -> Refusal:
    metrics.ERRORS.labels(code).inc()
    return Refusal(status, code, text)


def too_many_connections(limit: int) -> Refusal:
    return _refusal(HTTPStatus.TOO_MANY_REQUESTS, "too_many_connections",
                    f"this API key may have at most {limit} WebSockets open on this edge; close one first")


class Gate:
    """Decides each HTTP request / handshake on the edge's port: an ``Identity`` or a refusal."""

    def __init__(self, settings: EdgeSettings, plane: QueuePlane, chat_paths: frozenset[str]) -> None:
        self.settings = settings
        self.plane = plane
        #: Paths that serve chats: they need a key (when auth is on) and an allowed Origin.
        self.key_paths = self.browser_paths = chat_paths
        self.static_hashes = parse_csv(settings.api_key_hashes, lower=True)
        self.allowed_origins = parse_csv(settings.allowed_origins, lower=True)
        #: Setting hashes without ``auth_required`` still turns auth on: never fail open.
        self.enabled = settings.auth_required or bool(self.static_hashes)

    async def check(self, path: str, headers: HeaderLookup, ticket: str | None = None) -> Identity | Refusal:
        """Who a request to ``path`` comes from, or why it is refused (origin, key). A chat
        handshake without ``Authorization`` may bring a ``ticket`` instead (browsers)."""
        if path in self.browser_paths and not origin_allowed(headers.get("Origin"), self.allowed_origins):
            if ticket and self.enabled and path in self.key_paths and len(ticket) <= MAX_TICKET_CHARS:
                # Spent all the same: a ticket is worthless once shown, even to a refused handshake.
                with contextlib.suppress(QueueUnavailable):
                    await self.plane.fleet.take_ws_ticket(hash_key(ticket))
            return _refusal(HTTPStatus.FORBIDDEN, "forbidden_origin", "origin not allowed")
        needs_key = path in self.key_paths or (path in METRICS_PATHS and self.settings.protect_metrics)
        if not self.enabled or not needs_key:
            return ANONYMOUS
        key = bearer_token(headers)
        if key is None and ticket is not None and path in self.key_paths and not headers.getlist("Authorization"):
            return await self._redeem(ticket)
        if key is None:
            return _refusal(HTTPStatus.UNAUTHORIZED, "unauthorized",
                            "missing API key: send 'Authorization: Bearer <key>'")
        return await self._identify(hash_key(key), "invalid or revoked API key")

    async def _identify(self, key_hash: str, unknown: str) -> Identity | Refusal:
        try:
            identity = await self.lookup(key_hash)
        except QueueUnavailable as exc:
            log.warning("API key lookup failed: %s", exc)
            return _refusal(HTTPStatus.SERVICE_UNAVAILABLE, "auth_unavailable", "key store unavailable; retry")
        if identity is None:
            return _refusal(HTTPStatus.UNAUTHORIZED, "unauthorized", unknown)
        return identity

    # -- browser tickets -------------------------------------------------------------------

    async def issue_ticket(self, headers: HeaderLookup,
                           admit: Callable[[Identity], Awaitable[str | None]] | None = None) -> str | None | Refusal:
        """A new single-use ticket for the bearer key in ``headers`` (None when auth is off:
        a page then connects without one), or why not (401 without a valid key; 429 when
        ``admit`` says why the key may not have one now: its rate)."""
        if not origin_allowed(headers.get("Origin"), self.allowed_origins):
            return _refusal(HTTPStatus.FORBIDDEN, "forbidden_origin", "origin not allowed")
        if not self.enabled:
            return None
        key = bearer_token(headers)
        if key is None:
            return _refusal(HTTPStatus.UNAUTHORIZED, "unauthorized",
                            "a ticket needs an API key: send 'Authorization: Bearer <key>'")
        key_hash = hash_key(key)
        identity = await self._identify(key_hash, "invalid or revoked API key")
        if isinstance(identity, Refusal):
            return identity
        try:
            why_not = await admit(identity) if admit is not None else None
        except QueueUnavailable as exc:
            log.warning("ticket rate check failed: %s", exc)
            return _refusal(HTTPStatus.SERVICE_UNAVAILABLE, "auth_unavailable", "key store unavailable; retry")
        if why_not is not None:
            return _refusal(HTTPStatus.TOO_MANY_REQUESTS, "rate_limited", why_not)
        ticket = secrets.token_urlsafe(32)
        try:
            await self.plane.fleet.store_ws_ticket(hash_key(ticket), key_hash,
                                                   int(self.settings.ws_ticket_ttl_s * 1000))
        except QueueUnavailable as exc:
            log.warning("ticket store failed: %s", exc)
            return _refusal(HTTPStatus.SERVICE_UNAVAILABLE, "auth_unavailable", "key store unavailable; retry")
        return ticket

    async def _redeem(self, ticket: str) -> Identity | Refusal:
        """The identity a ticket stands for, spending it; 401 for any ticket that is not live."""
        refused = "invalid, expired or already used ticket: POST /v1/ws-ticket for a new one"
        if not ticket or len(ticket) > MAX_TICKET_CHARS:
            return _refusal(HTTPStatus.UNAUTHORIZED, "unauthorized", refused)
        try:
            key_hash = await self.plane.fleet.take_ws_ticket(hash_key(ticket))
        except QueueUnavailable as exc:
            log.warning("ticket lookup failed: %s", exc)
            return _refusal(HTTPStatus.SERVICE_UNAVAILABLE, "auth_unavailable", "key store unavailable; retry")
        if key_hash is None:
            return _refusal(HTTPStatus.UNAUTHORIZED, "unauthorized", refused)
        # Looked up again: a key revoked since the ticket was issued does not get in.
        return await self._identify(key_hash, "the ticket's API key was revoked")

    async def lookup(self, key_hash: str) -> Identity | None:
        """The identity of a key hash: settings' static list first, then Redis."""
        if key_hash in self.static_hashes:
            return Identity(key_id(key_hash), f"static:{key_hash[:8]}", limits_for(None, self.settings))
        raw = await self.plane.fleet.api_key(key_hash)
        if raw is None:
            return None
        try:
            record = decode_record(raw)
        except msgspec.DecodeError:
            log.warning("malformed API key record %s…; refusing it", key_hash[:8])
            return None
        return Identity(key_id(key_hash), record.name, limits_for(record, self.settings), key_hash)
