"""``lanes keys create|list|revoke``: API keys for the edge (see ``ws_server/auth.py``).

``create`` prints the key once, on stdout alone (``KEY=$(lanes keys create app)``), and
stores only its SHA-256 under ``lanes:keys:<hash>``; nobody can read a key back later.
Redis comes from ``LANES_REDIS_URL`` / ``LANES_KEY_PREFIX`` like every other process.
"""

from __future__ import annotations

import datetime
from typing import Annotated, Optional

import msgspec
import redis
import typer

from lanes.queue.keys import Keys
from lanes.queue.settings import RedisSettings
from lanes.ws_server.auth import decode_record, encode_record, generate_key, hash_key, new_record

app = typer.Typer(help="API keys: create (printed once, stored hashed), list, revoke.", no_args_is_help=True)


def _store() -> tuple[redis.Redis, Keys]:
    settings = RedisSettings()
    return redis.Redis.from_url(settings.redis_url), Keys(settings.key_prefix)


def _records(client: redis.Redis, keys: Keys) -> list[tuple[str, dict[str, object]]]:
    """(hash, record as a dict) for every stored key, oldest first."""
    found = []
    for name in client.scan_iter(match=keys.api_key_pattern, count=500):
        raw = client.get(name)
        if raw is None:
            continue
        key_hash = name.decode().rsplit(":", 1)[1]
        try:
            found.append((key_hash, msgspec.to_builtins(decode_record(raw))))
        except msgspec.DecodeError:
            found.append((key_hash, {"name": "<malformed record>", "created_at_s": 0.0}))
    return sorted(found, key=lambda item: float(item[1].get("created_at_s") or 0.0))  # type: ignore[arg-type]


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="who the key is for (shown in list and logs)")],
    rate_per_s: Annotated[Optional[float], typer.Option(help="requests/s (0 = unlimited; default: the edge's)")] = None,
    burst: Annotated[Optional[int], typer.Option(help="requests at once after idling (default: the edge's)")] = None,
    max_in_flight: Annotated[Optional[int], typer.Option(help="requests in flight (0 = unlimited)")] = None,
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
    client, keys = _store()
    try:
        if any(record.get("name") == name for _, record in _records(client, keys)):
            typer.echo(f"a key named {name!r} exists; revoke it first or pick another name", err=True)
            raise typer.Exit(1)
        client.set(keys.api_key(key_hash), encode_record(new_record(name, key, rate_per_s, burst, max_in_flight)))
    finally:
        client.close()
    typer.echo(key)
    typer.echo(f"stored sha256 {key_hash[:12]}… for {name!r}. This is the only time the key is shown.", err=True)


@app.command(name="list")
def list_keys() -> None:
    """Show stored keys (name, hash prefix, hint, limits); never the keys themselves."""
    client, keys = _store()
    try:
        records = _records(client, keys)
    finally:
        client.close()
    typer.echo(f"{'name':<24} {'sha256':<14} {'hint':<12} {'rate/s':>7} {'burst':>6} {'in-flight':>9}  created")
    for key_hash, r in records:
        created = datetime.datetime.fromtimestamp(float(r.get("created_at_s") or 0.0), datetime.UTC)  # type: ignore[arg-type]

        def show(value: object) -> str:
            return "default" if value is None else f"{value:g}" if isinstance(value, float) else str(value)

        typer.echo(f"{str(r.get('name')):<24} {key_hash[:12]:<14} {str(r.get('hint', '')):<12} "
                   f"{show(r.get('rate_per_s')):>7} {show(r.get('burst')):>6} {show(r.get('max_in_flight')):>9}  "
                   f"{created:%Y-%m-%d %H:%M}Z")


@app.command()
def revoke(
    which: Annotated[str, typer.Argument(help="a key's name, or a prefix (8+ hex chars) of its sha256")],
) -> None:
    """Delete a key's record: new handshakes with it get 401 (open connections run on until they close)."""
    client, keys = _store()
    try:
        hits = [h for h, r in _records(client, keys)
                if r.get("name") == which or (len(which) >= 8 and h.startswith(which.lower()))]
        for key_hash in hits:
            client.delete(keys.api_key(key_hash))
    finally:
        client.close()
    if not hits:
        typer.echo(f"no key named or hashed {which!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {len(hits)} key(s): {', '.join(h[:12] for h in hits)}")
