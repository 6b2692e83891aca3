"""Expected failures of the command line, and how they reach the user: one or two lines that
name the cause and the fix (the setting, the flag, the path), and an exit status.

Exit statuses (``lanes up`` and the process harness rely on them)::

    1   a failure that may pass by itself (a crash, a server that went away): restart it (also
        a write refused in a long-running process: the edge, a worker, the scheduler)
    2   a configuration error: restarting cannot help, the user must change something (also a
        write that a full disk, a read-only file system, a quota or a permission refused, in a
        one-shot command)
    130 interrupted (Ctrl-C)

Tracebacks are for bugs: an expected failure prints one only with ``--debug`` or
``LANES_DEBUG=1``.

Exception tree::

    Failure                 exit 1
    └── ConfigFailure       exit 2 (as are ``workers.engines.base.ConfigError`` and the routing
                            files' ``RulesError`` and ``FixedAnswersError``)
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic_settings import BaseSettings, SettingsConfigDict

SettingsT = TypeVar("SettingsT", bound=BaseSettings)

EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


class Failure(Exception):
    """An expected failure; ``str()`` is the whole message the user sees."""

    exit_code = EXIT_FAILURE


class ConfigFailure(Failure):
    """A setting, flag or path must change; retrying as it is cannot work."""

    exit_code = EXIT_CONFIG


class CliSettings(BaseSettings):
    """What the command line itself reads from the environment (prefix ``LANES_``)."""

    model_config = SettingsConfigDict(env_prefix="LANES_", extra="ignore")

    #: Show tracebacks for expected failures too (same as ``--debug``).
    debug: bool = False


#: ``LANES_*`` variables read outside the settings classes (the Procfile, bootstrap, tests).
OTHER_VARIABLES = frozenset({"LANES_BIN", "LANES_TORCH_VERSION", "LANES_TEST_TIME_SCALE", "LANES_SCREENSHOT_DIR",
                             "LANES_API_KEY"})


def known_variables() -> frozenset[str]:
    """Every ``LANES_*`` variable some lanes process reads."""
    from lanes.scheduler.settings import SchedulerSettings
    from lanes.workers.settings import WorkerSettings
    from lanes.ws_server.settings import EdgeSettings

    fields = {name for cls in (EdgeSettings, WorkerSettings, SchedulerSettings, CliSettings) for name in cls.model_fields}
    return frozenset(f"LANES_{name.upper()}" for name in fields) | OTHER_VARIABLES


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``LANES_*`` variable that no process reads: pydantic-settings ignores
    them, so a typo (``LANES_AUTH_REQURED=true``) would otherwise leave the default (auth off)
    without a word. Names the closest real setting."""
    known = known_variables()
    suffixes = {name.removeprefix("LANES_"): name for name in known}
    warnings = []
    for name in sorted(n for n in environ if n.upper().startswith("LANES_") and n.upper() not in known):
        close = difflib.get_close_matches(name.upper().removeprefix("LANES_"), suffixes, n=1, cutoff=0.7)
        hint = f"; did you mean {suffixes[close[0]]}?" if close else ""
        warnings.append(f"{name} is not a lanes setting and is ignored{hint}")
    return warnings


def safe_url(url: str) -> str:
    """``url`` without its password (``redis://:secret@h:1/0`` -> ``redis://:***@h:1/0``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


#: Errors of a write the user must make room or permission for: retrying as it is cannot help.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT})
#: Of those, the ones that clear by themselves under a running service (space freed).
_CLEARING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def write_error(exc: BaseException) -> str | None:
    """``cannot write PATH: No space left on device`` for a write that a full disk, a read-only
    file system, a quota or a permission stopped (before, a page of traceback after a model or
    plot was built); None for anything else. safetensors raises its own error for these, with
    the OS's words and ``(os error 28)`` but no path."""
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
        what = exc.strerror or os.strerror(exc.errno)
        if exc.filename is None:  # a socket's EACCES (a port below 1024) is no write
            return None if exc.errno == errno.EACCES else f"cannot write: {what}"
        name = exc.filename
        path = os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(name)  # an fd: an int
        # A permission refused may have been a read, an exec or a listing: "access" guesses nothing.
        verb = "access" if exc.errno == errno.EACCES else "write"
        return f"cannot {verb} {path}: {what}"
    if type(exc).__name__ == "SafetensorError":
        number = re.search(r"\(os error (\d+)\)", str(exc))
        if number and int(number.group(1)) in _WRITE_ERRNOS:
            return f"cannot write the weights (safetensors): {os.strerror(int(number.group(1)))}"
    return None


def exit_code_for(exc: BaseException, *, long_running: bool = False) -> int | None:
    """The exit status of an expected failure, or None for anything else (a bug).

    A refused write (``write_error``) is 2 for a one-shot command (``lanes model tiny``: the
    user makes room and runs it again). In a ``long_running`` process (edge, worker, scheduler)
    a full disk or quota is 1: one that filled up under a running service is usually freed
    again (logs rotated, a temporary file removed), and ``lanes up``, like systemd or
    Kubernetes, restarts an exit 1 with backoff, where an exit 2 stopped every process, with
    every stream in flight, for good. A read-only file system or a refused permission stays 2
    there too: it does not clear by itself, and restarting would loop on it."""
    from lanes.scheduler.predictor import WeightsError
    from lanes.scheduler.router.fixed_answers import FixedAnswersError
    from lanes.scheduler.router.rules import RulesError
    from lanes.workers.engines.base import ConfigError

    if isinstance(exc, Failure):
        return exc.exit_code
    if isinstance(exc, (ConfigError, RulesError, FixedAnswersError, WeightsError)) or settings_error(exc) is not None:
        return EXIT_CONFIG
    if write_error(exc) is not None:
        clears = isinstance(exc, OSError) and exc.errno in _CLEARING_ERRNOS
        return EXIT_FAILURE if long_running and clears else EXIT_CONFIG
    return None


def settings_error(exc: BaseException, flags: Collection[str] = ()) -> str | None:
    """The message for a settings class (``*Settings``) that refused its values, one clause per
    setting (``LANES_MAX_SLOTS='abc': Input should be a valid integer``, or ``--max-slots='abc'``
    for a field in ``flags``, given on the command line); None for anything else. Passwords in
    URLs are masked and secret-looking values are not echoed."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError) or not exc.title.endswith("Settings"):
        return None
    clauses = []
    for error in exc.errors(include_url=False):
        loc = error.get("loc") or ()
        if not loc:
            clauses.append(error["msg"])
            continue
        field = str(loc[0])
        value = error.get("input")
        if "url" in field and isinstance(value, str):
            value = safe_url(value)
        shown = "" if any(word in field for word in ("password", "secret", "api_key")) else f"={value!r}"
        name = f"--{field.replace('_', '-')}" if field in flags else f"LANES_{field.upper()}"
        clauses.append(f"{name}{shown}: {error['msg']}")
    return (f"{exc.title} refused: {'; '.join(clauses)} (fix or unset it in the environment or its "
            "command-line flag)")


def load_settings(cls: type[SettingsT], flags: Mapping[str, Any]) -> SettingsT:
    """``cls(**flags)``: a process's settings, its command-line flags over the environment. A
    refusal names a value that came from a flag by the flag (``--engine='foo'``), not by the
    variable the user never set."""
    from pydantic import ValidationError

    try:
        return cls(**flags)
    except ValidationError as exc:
        message = settings_error(exc, flags)
        if message is None:
            raise
        raise ConfigFailure(message) from exc


def report(exc: BaseException, *, long_running: bool = False) -> int | None:
    """Print an expected failure as one message on stderr; returns its exit status, or None
    (print nothing) when ``exc`` is not an expected failure (``long_running``: see
    ``exit_code_for``)."""
    code = exit_code_for(exc, long_running=long_running)
    if code is None:
        return None
    written = write_error(exc)
    prefix = "configuration error" if code == EXIT_CONFIG and written is None else "error"
    print(f"{prefix}: {settings_error(exc) or written or exc}", file=sys.stderr, flush=True)
    return code


def writable_file(path: Path | None) -> Path | None:
    """Typer callback for an output file: its directory must exist or be creatable, and be
    writable, checked before the work starts (a benchmark that ran for minutes and then could
    not write its result lost it, with a traceback)."""
    if path is not None:
        target = path.expanduser().absolute()
        if target.is_dir():
            import typer

            raise typer.BadParameter(f"{path} is a directory; give a file name")
        writable_dir(target.parent)
        if target.is_file():  # one there already: it must open for writing too (append: nothing is cut)
            try:
                os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
            except OSError as exc:
                import typer

                raise typer.BadParameter(f"cannot write {target}: {exc.strerror or exc}") from None
    return path


def _try_writing(directory: Path) -> OSError | None:
    """Create and remove a file in ``directory``; the error if that fails. ``os.access`` says yes
    to root everywhere (``/sys``, ``/proc`` too), so only a real file tells."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".lanes-probe-"):
            pass
    except OSError as exc:
        return exc
    return None


def writable_dir(path: Path) -> Path:
    """Typer callback for an output directory: created if missing, and writable."""
    import typer

    target = path.expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(f"cannot create the directory {target}: {exc.strerror or exc}") from None
    if (exc := _try_writing(target)) is not None:
        raise typer.BadParameter(f"cannot write into {target}: {exc.strerror or exc}") from None
    return path


def creatable_dir(path: Path) -> Path:
    """Typer callback for an output directory made only once the work succeeds: it exists and is
    writable, or the nearest folder above it that exists is (nothing is created now)."""
    import typer

    target = path.expanduser().absolute()
    existing = next((p for p in (target, *target.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise typer.BadParameter(f"cannot create the directory {target}: {existing} is not a directory")
    if (exc := _try_writing(existing)) is not None:
        raise typer.BadParameter(f"cannot create the directory {target}: {exc.strerror or exc}") from None
    return path
