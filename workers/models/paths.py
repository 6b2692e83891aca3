"""Where the models live: the shipped demo model, and how a ``--model`` setting is resolved.

Kept free of torch and transformers so that settings code and the CLI can import it cheaply.
``check_model`` turns the two usual mistakes (a directory that does not exist, a hub id that
is not in the offline cache) into a ``ConfigError`` at start-up instead of a loader traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from lanes.workers.engines.base import ConfigError

#: The trained demo model shipped in the package (``lanes model train-demo`` writes it).
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET_DIR = DEMO_MODEL_DIR / "target"
DEMO_DRAFT_DIR = DEMO_MODEL_DIR / "draft"


def resolve_model(spec: str) -> str:
    """What to pass to ``from_pretrained`` for a ``model`` setting.

    Empty means the shipped demo model; an existing local directory is used as it is; anything
    else is returned unchanged as a Hugging Face hub id. A hub id needs network access or a
    populated Hugging Face cache (with ``HF_HUB_OFFLINE=1`` it must already be cached).
    """
    if not spec:
        return str(DEMO_TARGET_DIR)
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser())
    return spec


def resolve_draft(spec: str, model_spec: str) -> str:
    """What to pass to ``from_pretrained`` for a ``draft_model`` setting, or ``""`` for none.

    An empty draft with the demo model (an empty ``model_spec`` or the demo target directory)
    means the demo's own draft; an empty draft with any other model means no draft, since a
    draft must share the target's tokenizer. Otherwise resolved like ``resolve_model``.
    """
    if spec:
        return resolve_model(spec)
    if not model_spec or Path(model_spec).expanduser().resolve() == DEMO_TARGET_DIR:
        return str(DEMO_DRAFT_DIR)
    return ""


def looks_like_path(spec: str) -> bool:
    """A setting meant as a local directory: absolute, relative (``./x``), ``~`` or with
    more than one ``/`` (a hub id is ``name`` or ``org/name``)."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or os.sep != "/" and os.sep in spec


def check_model(spec: str, setting: str = "--model / LANES_MODEL") -> None:
    """Raise ``ConfigError`` naming ``setting`` if ``spec`` (already resolved) cannot load:
    a missing directory, a directory without ``config.json`` (``params.json`` for Mistral's own
    format), a file other than a GGUF, a malformed hub id, or a hub id absent from the cache
    while offline or while the hub cannot be reached (one probe, ``hub_unreachable``)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in ("config.json", "params.json")):
            raise ConfigError(f"{spec} is not a Hugging Face model directory: it has no config.json ({setting}); "
                              "give the directory that holds config.json, the weights and the tokenizer files")
        return
    if path.is_file():
        if path.suffix == ".gguf":  # vLLM loads a GGUF file
            return
        raise ConfigError(f"{spec} is a file, not a model directory ({setting}): give the directory that holds "
                          "config.json, the weights and the tokenizer files")
    if looks_like_path(spec):
        raise ConfigError(f"model directory {spec} does not exist ({setting}): give a Hugging Face "
                          "model directory, or a hub id such as Qwen/Qwen2.5-0.5B-Instruct")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        raise ConfigError(f"model {spec!r} is neither a directory nor a Hugging Face hub id "
                          f"({setting})") from None
    if isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return
    if not constants.HF_HUB_OFFLINE and (why := hub_unreachable()) is not None:
        # Before: huggingface_hub retried for ~50 s (22 warning lines) and the loader's
        # message said "check your internet connection", not what to do here.
        raise ConfigError(
            f"model {spec} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the hub at "
            f"{constants.ENDPOINT} cannot be reached ({why}) ({setting}): download it where the hub is "
            f"reachable (`hf download {spec}`) and copy the cache to this machine, point HF_ENDPOINT at a mirror "
            "you can reach, or give a local model directory")
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"model {spec} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"HF_HUB_OFFLINE=1 forbids downloading it ({setting}): download it first "
            f"(`hf download {spec}`), set HF_HUB_OFFLINE=0 (`lanes up` and scripts/up.sh run offline unless it "
            f"is set: `HF_HUB_OFFLINE=0 lanes up --model {spec}` downloads it), or give a local model directory")


def hub_unreachable(timeout_s: float = 5.0) -> str | None:
    """Why the Hugging Face hub (``HF_ENDPOINT``) cannot be reached, in a few words, or None if it
    answers at all (any HTTP status). One request through huggingface_hub's own session, so its
    proxy settings apply, and no retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - a probe: whatever stopped it is the answer
        text = str(exc).strip()
        if "name or service not known" in text.lower() or "nodename nor servname" in text.lower():
            return "its name does not resolve: no network or no DNS here"
        return text.splitlines()[0] if text else type(exc).__name__
    return None
