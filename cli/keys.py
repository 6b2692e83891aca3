"""``lanes keys create|list|revoke``: API keys for the edge (see ``ws_server/auth.py``).

``create`` prints the key once, on stdout alone (``KEY=$(lanes keys create app)``), and
stores only its SHA-256 under ``lanes:keys:<hash>``; nobody can read a key back later.
Redis comes from ``LANES_REDIS_URL`` / ``LANES_KEY_PREFIX`` like every other process.
"""

from __future__ import annotations

import asyncio
import datetime
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable
from typing import Annotated, Optional, TypeVar

import msgspec
import typer
from lanes.queue.fleet import Fleet
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings
from lanes.ws_server.auth import (
    decode_record,
    encode_record,
    generate_key,
    hash_key,
    new_record,
)

app = typer.Typer(help="API keys: create (printed once, stored hashed), list, revoke.", no_args_is_help=True)


T = TypeVar("T")


def _with_store(use: Callable[[Fleet], Awaitable[T]], *, writes: bool = True) -> T:
    """Run ``use`` against the key store (``LANES_REDIS_URL`` / ``LANES_KEY_PREFIX``); one that
    only reads (``writes=False``) may run on a replica."""

    async def run() -> T:
        from lanes.cli.entrypoints import check_redis

        plane = QueuePlane.from_settings(RedisSettings())
        try:
            await check_redis(plane, writes=writes)  # an unreachable Redis is one line naming LANES_REDIS_URL
            return await use(plane.fleet)
        finally:
            await plane.close()

    # A thread of its own: ``asyncio.run`` refuses to start inside a running loop (a caller
    # that is itself async, e.g. a test driving the CLI in-process).
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run()).result()


async def _records(fleet: Fleet) -> list[tuple[str, dict[str, object]]]:
    """(hash, record as a dict) for every stored key, oldest first."""
    found = []
    for key_hash, raw in await fleet.api_keys():
        try:
            found.append((key_hash, msgspec.to_builtins(decode_record(raw))))
        except msgspec.DecodeError:
            found.append((key_hash, {"name": "<malformed record>", "created_at_s": 0.0}))
    return sorted(found, key=lambda item: float(item[1].get("created_at_s") or 0.0))  # type: ignore[arg-type]


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="who the key is for (shown in list and logs)")],
    rate_per_s: Annotated[Optional[float], typer.Option(help="requests/s (0 = unlimited; default: the edge's)",
                                                        min=0)] = None,
    burst: Annotated[Optional[int], typer.Option(help="requests at once after idling (default: the edge's)",
                                                 min=0)] = None,
    max_in_flight: Annotated[Optional[int], typer.Option(help="requests in flight (0 = unlimited)", min=0)] = None,
    max_connections: Annotated[Optional[int], typer.Option(
        help="WebSockets open at once per edge (0 = unlimited; default: the edge's)", min=0)] = None,
    static: Annotated[bool, typer.Option(
        "--static", help="store nothing: print the key and its hash for LANES_API_KEY_HASHES")] = False,
) -> None:
    """Make a key; print it once; keep only its SHA-256."""
    key = generate_key()
    key_hash = hash_key(key)
    if static:
        typer.echo(key)
        typer.echo(f"add to LANES_API_KEY_HASHES: {key_hash}", err=True)
        return
    async def store(fleet: Fleet) -> bool:
        if any(record.get("name") == name for _, record in await _records(fleet)):
            return False
        await fleet.put_api_key(key_hash, encode_record(new_record(name, key, rate_per_s, burst, max_in_flight,
                                                                max_connections=max_connections)))
        return True

    if not _with_store(store):
        typer.echo(f"a key named {name!r} exists; revoke it first or pick another name", err=True)
        raise typer.Exit(1)
    typer.echo(key)
    typer.echo(f"stored sha256 {key_hash[:12]}… for {name!r}. This is the only time the key is shown.", err=True)


@app.command(name="list")
def list_keys() -> None:
    """Show stored keys (name, hash prefix, hint, limits); never the keys themselves."""
    records = _with_store(_records, writes=False)  # reads only: a replica serves it
    typer.echo(f"{'name':<24} {'sha256':<14} {'hint':<12} {'rate/s':>7} {'burst':>6} {'in-flight':>9} "
               f"{'conns':>7}  created")
    for key_hash, r in records:
        created = datetime.datetime.fromtimestamp(float(r.get("created_at_s") or 0.0), datetime.UTC)  # type: ignore[arg-type]

        def show(value: object) -> str:
            return "default" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

        typer.echo(f"{str(r.get('name')):<24} {key_hash[:12]:<14} {str(r.get('hint', '')):<12} "
                   f"{show(r.get('rate_per_s')):>7} {show(r.get('burst')):>6} {show(r.get('max_in_flight')):>9} "
                   f"{show(r.get('max_connections')):>7}  "
                   f"{created:%Y-%m-%d %H:%M}Z")


@app.command()
def revoke(
    which: Annotated[str, typer.Argument(help="a key's name, or a prefix (8+ hex chars) of its sha256")],
) -> None:
    """Delete a key's record: new handshakes with it get 401; each edge closes its open WebSockets
    (code 4003) and cancels their requests within LANES_KEY_RECHECK_S (5 s)."""
    async def revoke_matching(fleet: Fleet) -> list[str]:
        hits = [h for h, r in await _records(fleet)
                if r.get("name") == which or (len(which) >= 8 and h.startswith(which.lower()))]
        for key_hash in hits:
            await fleet.delete_api_key(key_hash)
        return hits

    hits = _with_store(revoke_matching)
    if not hits:
        typer.echo(f"no key named or hashed {which!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {len(hits)} key(s): {', '.join(h[:12] for h in hits)}")
