"""English training text that ships with CPython, so the offline models need no download.

Two sources, both PSF-licensed and present wherever the interpreter is:

- ``pydoc_data.topics``: the language reference topics behind ``help()`` (about 465 KB);
- docstrings of the standard library's own modules, classes and functions, read with ``ast``
  (about 1.45 MB; nothing is imported, so no module's side effects run).

Every iterator yields in a fixed order (sorted topic names, sorted file paths, ``ast.walk``
order) and caches nothing, so the same interpreter always gives the same corpus and therefore
the same tokenizer and the same trained weights for a given seed.
"""

from __future__ import annotations

import ast
import itertools
import sysconfig
from collections.abc import Iterator
from pathlib import Path

#: Docstrings shorter than this are mostly one-line summaries ("Return self.") that teach little.
MIN_DOCSTRING_CHARS = 80

# Test suites, demos and vendored code are not documentation prose.
_SKIPPED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
    "ensurepip", "pydoc_data", "__pycache__",
})
_DOCUMENTED_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def pydoc_topics() -> Iterator[str]:
    """The ``help()`` topic texts, in sorted topic order."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def stdlib_docstrings(min_chars: int = MIN_DOCSTRING_CHARS) -> Iterator[str]:
    """Docstrings longer than ``min_chars`` from the standard library's ``.py`` files.

    Takes about 4 s (parsing ~575 files). Files that do not parse are skipped.
    """
    for path in _stdlib_sources():
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOCUMENTED_NODES):
                doc = ast.get_docstring(node)
                if doc and len(doc) > min_chars:
                    yield doc


def demo_corpus() -> Iterator[str]:
    """The demo model's training text: the pydoc topics, then the stdlib docstrings."""
    return itertools.chain(pydoc_topics(), stdlib_docstrings())


def _stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        path
        for path in sorted(root.rglob("*.py"))
        if not _is_skipped(path.relative_to(root).parts)
    ]


def _is_skipped(parts: tuple[str, ...]) -> bool:
    dirs, name = parts[:-1], parts[-1]
    return name.startswith("test_") or any(
        part in _SKIPPED_DIRS or part.startswith("test") for part in dirs
    )
