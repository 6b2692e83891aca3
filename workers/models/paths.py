"""Where the models live: the shipped demo model, and how a ``--model`` setting is resolved.

Kept free of torch and transformers so that settings code and the CLI can import it cheaply.
"""

from __future__ import annotations

from pathlib import Path

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
