"""Operator routing rules: a TOML file parsed once into an immutable ``RoutingRules``.

File format (``deploy/routing.toml`` is the sample)::

    default_pool = "large"            # model absent, or no tier fits: this pool
    pools = ["small", "large"]        # enabled pools; only these are ever chosen

    [[tiers]]                         # "auto": first tier whose limits the prompt fits
    pool = "small"
    max_complexity = 0.25             # hardness percentile, 0..1 (complexity.py)
    max_prompt_chars = 8000           # optional: longer prompts skip this tier

    [[tiers]]
    pool = "large"
    max_complexity = 1.0

    [keys]                            # API key id -> pool, beats everything else
    "3f9a0c12d4e5" = "large"

Every error names the field that is wrong (``RulesError``). Parsing is pure; ``load_rules``
only reads the file.
"""

from __future__ import annotations

import re

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The ``model`` value that asks the router to choose.
AUTO = "auto"


class RulesError(ValueError):
    """A routing rules file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Tier:
    """One step of the "auto" ladder."""

    pool: str
    #: Prompts with complexity <= this (0..1) may go to ``pool``.
    max_complexity: float
    #: Prompts longer than this (characters) skip the tier; None: no limit.
    max_prompt_chars: int | None = None


@dataclass(frozen=True)
class RoutingRules:
    """Immutable routing configuration (see the module docstring for the file format)."""

    default_pool: str
    pools: frozenset[str]
    tiers: tuple[Tier, ...] = ()
    #: API key id -> pool; wins over ``model`` and the complexity estimate.
    key_pools: Mapping[str, str] = field(default_factory=dict)


#: What a worker's ``LANES_POOL`` may be: a pool named otherwise could never have a worker.
POOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _pool(value: Any, where: str, pools: frozenset[str]) -> str:
    if not isinstance(value, str) or not value:
        raise RulesError(f"{where}: a pool name (non-empty string) is required, got {value!r}")
    if not POOL_NAME.fullmatch(value):
        raise RulesError(f"{where}: pool {value!r} is not a name a worker can serve (LANES_POOL: 1 to 64 of "
                         "letters, digits, '_', '.', '-')")
    if value not in pools:
        raise RulesError(f"{where}: pool {value!r} is not in pools {sorted(pools)}")
    return value


def _tier(raw: Any, index: int, pools: frozenset[str]) -> Tier:
    where = f"tiers[{index}]"
    if not isinstance(raw, dict):
        raise RulesError(f"{where}: a table is required")
    unknown = set(raw) - {"pool", "max_complexity", "max_prompt_chars"}
    if unknown:
        raise RulesError(f"{where}: unknown fields {sorted(unknown)}")
    limit = raw.get("max_complexity")
    if isinstance(limit, bool) or not isinstance(limit, int | float) or not 0.0 <= limit <= 1.0:
        raise RulesError(f"{where}.max_complexity: a number in [0, 1] is required, got {limit!r}")
    chars = raw.get("max_prompt_chars")
    if chars is not None and (isinstance(chars, bool) or not isinstance(chars, int) or chars <= 0):
        raise RulesError(f"{where}.max_prompt_chars: a positive integer is required, got {chars!r}")
    return Tier(_pool(raw.get("pool"), f"{where}.pool", pools), float(limit), chars)


def parse_rules(raw: Mapping[str, Any]) -> RoutingRules:
    """Validate a parsed TOML document. Raises ``RulesError`` naming the offending field."""
    unknown = set(raw) - {"default_pool", "pools", "tiers", "keys"}
    if unknown:
        raise RulesError(f"unknown top-level fields {sorted(unknown)}")
    names = raw.get("pools")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise RulesError(f"pools: a non-empty list of pool names is required, got {names!r}")
    if any(n == AUTO for n in names):
        raise RulesError(f"pools: {AUTO!r} is reserved for routing")
    for n in names:
        if not POOL_NAME.fullmatch(n):
            raise RulesError(f"pools: {n!r} is not a name a worker can serve (LANES_POOL: 1 to 64 of letters, "
                             "digits, '_', '.', '-')")
    pools = frozenset(names)
    default_pool = _pool(raw.get("default_pool"), "default_pool", pools)
    tiers_raw = raw.get("tiers", [])
    if not isinstance(tiers_raw, list):
        raise RulesError("tiers: an array of tables ([[tiers]]) is required")
    tiers = tuple(_tier(t, i, pools) for i, t in enumerate(tiers_raw))
    limits = [t.max_complexity for t in tiers]
    if limits != sorted(limits):
        raise RulesError(f"tiers: max_complexity must not decrease from one tier to the next, got {limits}")
    keys_raw = raw.get("keys", {})
    if not isinstance(keys_raw, dict):
        raise RulesError("keys: a table of key id = pool is required")
    for k in keys_raw:
        if not re.fullmatch(r"[0-9a-f]{12,64}", str(k)):
            raise RulesError(f"keys.{k}: a key id is the start of the key's SHA-256, 12 to 64 lowercase hex "
                             "digits (the sha256 column of `lanes keys list`)")
    key_pools = {str(k): _pool(v, f"keys.{k}", pools) for k, v in keys_raw.items()}
    return RoutingRules(default_pool, pools, tiers, key_pools)


def load_rules(path: Path) -> RoutingRules:
    """Read and validate a rules file. Raises ``RulesError`` (also for TOML syntax errors and a
    file that cannot be read)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except OSError as err:
        raise RulesError(f"{path}: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise RulesError(f"{path}: not UTF-8 text (saved as UTF-16 or another encoding?): save it as UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        raise RulesError(f"{path}: {err}") from None
    try:
        return parse_rules(raw)
    except RulesError as err:
        raise RulesError(f"{path}: {err}") from None
