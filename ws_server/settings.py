"""The edge process's settings (env prefix ``LANES_``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from lanes.queue.settings import RedisSettings
from lanes.scheduler.live_policy import DEFAULT_ROUTING
from lanes.ws_server.delivery import DeliveryConfig
from lanes.ws_server.protocol import Limits


class EdgeSettings(RedisSettings):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    edge_id: str = ""
    max_frame_bytes: int = Field(256 * 1024, ge=1024)
    max_messages: int = Field(64, ge=1)
    max_prompt_chars: int = Field(64 * 1024, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    default_max_tokens: int = Field(256, ge=1)
    #: Requests one connection may have in flight.
    max_in_flight_per_connection: int = Field(64, ge=1)
    #: Frames waiting for a client whose transport is backed up (it does not read) before it
    #: counts as too slow and is closed (4008); a burst to a client that reads never counts.
    max_client_queue_frames: int = Field(4096, ge=1)
    #: After a cancel of a running request, how long to wait for the worker's final frame.
    cancel_grace_s: float = Field(2.0, ge=0, allow_inf_nan=False)
    #: A client that disconnects has this long to ``resume`` (from any connection, same key)
    #: before its requests are cancelled; 0 cancels at once.
    resume_grace_s: float = Field(15.0, ge=0, allow_inf_nan=False)
    #: A running request of which nothing has been heard this long (no token, and Redis answered
    #: none of the edge's checks of it: Redis is out of reach) ends ``unavailable`` (503 on the
    #: HTTP API) instead of waiting out the outage; it must exceed a check's few seconds.
    unreachable_s: float = Field(30.0, ge=10, allow_inf_nan=False)
    #: Lane thresholds in the predictor's units (Llama-3 tokens). For the shipped predictor, 150/750
    #: give ~12 % short, ~2 % long, with 0.9 % of truly short answers (of 213 models, on sources
    #: the predictor never saw) routed long (benchmarks/RESULTS.md, "Length predictor (issue 9)").
    #: At least 1: below it the short lane stayed empty without a word. Equal thresholds are
    #: allowed: two lanes, short and long (the live benchmarks run so).
    short_max_tokens: int = Field(DEFAULT_ROUTING.short_max_tokens, ge=1)
    medium_max_tokens: int = Field(DEFAULT_ROUTING.medium_max_tokens, ge=1)
    #: Once the scheduler has refreshed the predictor on this deployment's finished requests, route
    #: by the thresholds fitted with it (two lanes, at most 0.5 % of short answers sent long;
    #: ``scheduler/refresh.py``) instead of the two above. Unset: follow them unless one of the two
    #: above was set explicitly; false pins the two above; true follows even so.
    follow_refreshed_routing: bool | None = None
    #: How often the edge asks Redis for a newer refreshed predictor (one small read; the
    #: weights cross the network only when a new version is there).
    predictor_poll_s: float = Field(default=5.0, gt=0.0, allow_inf_nan=False)

    @property
    def follows_refreshed_routing(self) -> bool:
        if self.follow_refreshed_routing is not None:
            return self.follow_refreshed_routing
        return not {"short_max_tokens", "medium_max_tokens"} & self.model_fields_set
    #: Admission: most requests a lane may hold before new ones are refused (``overloaded``).
    max_depth_short: int = Field(2000, ge=0)
    max_depth_medium: int = Field(2000, ge=0)
    max_depth_long: int = Field(1000, ge=0)
    #: Refuse a request whose predicted queueing exceeds this (ms; 0 = only the client's
    #: own ``deadline_ms``).
    default_deadline_ms: int = Field(0, ge=0)
    #: Require an API key at the WebSocket handshake (``Authorization: Bearer <key>``).
    #: Off only for the local demo; a non-empty ``api_key_hashes`` turns it on too.
    auth_required: bool = False
    #: Comma list of SHA-256 hex digests of accepted keys (``lanes keys create --static``),
    #: accepted besides the keys stored in Redis (``lanes:keys:<hash>``).
    api_key_hashes: str = ""

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes(cls, text: str) -> str:
        for item in (i.strip() for i in text.split(",")):
            if item and not re.fullmatch(r"[0-9a-fA-F]{64}", item):
                looks_like_key = item.startswith("lanes_")
                raise ValueError("each entry must be a SHA-256 hex digest (64 hex digits) of a key"
                                 + (", not the key itself" if looks_like_key else "")
                                 + ": `lanes keys create NAME --static` prints a key and its digest; "
                                 "`printf %s KEY | sha256sum` gives an existing key's")
        return text
    #: With auth on, ``/metrics`` and ``/v1/depths`` need a key too; false leaves them open
    #: (a Prometheus scraper on a private network). ``/healthz`` and the dashboard page stay open.
    protect_metrics: bool = True
    #: How long a browser's WebSocket ticket (``POST /v1/ws-ticket``) stays valid; it works once.
    ws_ticket_ttl_s: float = Field(10.0, gt=0, allow_inf_nan=False)
    #: How often an edge checks that the keys of its open WebSockets and OpenAI requests are not
    #: revoked (closing those that are, 4003 or a 401, and cancelling their requests); 0 = only
    #: at the handshake.
    key_recheck_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    #: Comma list of browser origins allowed to open the chat socket
    #: (``https://app.example.com``); empty allows any (non-browser clients send no Origin).
    #: The same origins, and only they, are granted CORS on the HTTP API (``asgi._AllowlistCORS``).
    allowed_origins: str = ""

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, text: str) -> str:
        for item in (i.strip() for i in text.split(",")):
            if item and not re.fullmatch(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s]+/?", item):
                raise ValueError(f"{item!r} is not an origin: give each as scheme://host[:port] "
                                 "(https://app.example.com); leave the list empty to allow any origin's "
                                 "WebSocket (and CORS for none)")
        return text
    #: Per-key limits for keys that set none (and for ``api_key_hashes``); 0 = no limit.
    #: Enforced per edge process (see ``ratelimit.py``).
    #: ``edge``: each edge process enforces a key's rate on its own (N edges: up to N x the
    #: rate); ``fleet``: one token bucket per key in Redis, shared by every edge (+1 Lua call).
    rate_limit_scope: Literal["edge", "fleet"] = "edge"
    key_rate_per_s: float = Field(10.0, ge=0, allow_inf_nan=False)
    key_burst: int = Field(20, ge=0)
    key_max_in_flight: int = Field(32, ge=0)
    #: WebSockets one key may hold open on one edge (0 = unlimited): one tenant cannot take
    #: every file descriptor of an edge.
    key_max_connections: int = Field(256, ge=0)
    #: Kernel send buffer per client socket (bytes; 0 = the OS default). Linux autotunes it up
    #: to 4 MiB on a fast link, so a client that stops reading would hold ~80k frames in the
    #: kernel before the edge's queue (``max_client_queue_frames``) ever filled.
    client_send_buffer_bytes: int = Field(64 * 1024, ge=0)
    #: Routing rules for ``model: "auto"`` and API-key overrides (TOML, ``deploy/routing.toml``);
    #: empty: ``model`` names a pool, none or ``auto`` is the default pool.
    routing_file: str = ""
    #: Questions the edge answers itself, without a model (TOML, ``deploy/fixed_answers.toml``).
    fixed_answers_file: str = ""
    #: Offer permessage-deflate. Off by default: token frames are ~60-byte JSON that deflate
    #: barely shrinks, while each compressed connection costs ~300 KB of zlib state (memory
    #: that fragments: 4.8 KB of RSS left per finished connection with it, 0.4 KB without)
    #: and about a fifth of the edge's CPU per token (benchmarks/RESULTS.md).
    ws_compression: bool = False
    #: After closing a too-slow client (4008), how long it gets to read up to the close frame
    #: before the edge drops the TCP connection (and with it the client's requests).
    slow_client_close_timeout_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    #: WebSocket keepalive: a ping this often; a connection whose client has not answered it
    #: within the timeout is closed (and dropped ``slow_client_close_timeout_s`` later if the
    #: client does not read up to the close frame).
    ws_ping_interval_s: float = Field(20.0, gt=0, allow_inf_nan=False)
    ws_ping_timeout_s: float = Field(20.0, gt=0, allow_inf_nan=False)
    #: A connection that has not sent a whole request head (HTTP headers, or the WebSocket
    #: upgrade) this long after it opened, or after its previous response, is closed.
    header_timeout_s: float = Field(10.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _default_within_limit(self) -> EdgeSettings:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"LANES_DEFAULT_MAX_TOKENS ({self.default_max_tokens}) is above LANES_MAX_TOKENS_LIMIT "
                             f"({self.max_tokens_limit}): every chat without max_tokens would be refused")
        if self.medium_max_tokens < self.short_max_tokens:
            raise ValueError(f"LANES_MEDIUM_MAX_TOKENS ({self.medium_max_tokens}) is below LANES_SHORT_MAX_TOKENS "
                             f"({self.short_max_tokens})")
        return self

    def limits(self) -> Limits:
        """The protocol parser's input limits."""
        return Limits(max_frame_bytes=self.max_frame_bytes, max_messages=self.max_messages,
                      max_prompt_chars=self.max_prompt_chars, max_tokens_limit=self.max_tokens_limit,
                      default_max_tokens=self.default_max_tokens)

    def delivery(self) -> DeliveryConfig:
        """The delivery core's timers and caps. A resume re-reads the stream two heartbeats later:
        the worker learns the new edge only at its next heartbeat."""
        return DeliveryConfig(resume_grace_s=self.resume_grace_s, cancel_grace_s=self.cancel_grace_s,
                              refill_after_s=2 * self.heartbeat_s + 0.1, unreachable_s=self.unreachable_s,
                              max_in_flight_per_connection=self.max_in_flight_per_connection)
