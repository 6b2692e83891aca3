"""``scripts/bootstrap.sh`` on a machine that cannot make a working venv, with a stand-in
``python3`` (a shell script) so no real venv or torch is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: A ``python3`` of version ``$FAKE_VERSION`` whose ``-m venv DIR`` makes a venv with pip
#: (``$FAKE_VENV=ok``), or, like Debian without python3-venv, one with a python but no pip.
FAKE_PYTHON = r"""#!/usr/bin/env bash
if [ "$1" = -c ]; then
  case "$2" in *print*) echo "${FAKE_VERSION:-3.12}"; exit;; esac
  [ "${FAKE_VERSION:-3.12}" != 3.10 ]; exit
fi
if [ "$1" = -V ]; then echo "Python ${FAKE_VERSION:-3.12}"; exit; fi
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  if [ "${FAKE_VENV:-ok}" = ok ]; then
    printf '#!/usr/bin/env bash\necho "$*" >> "$(dirname "$0")/../calls"\n' > "$3/bin/python"
  else
    printf '#!/usr/bin/env bash\nexit 1\n' > "$3/bin/python"
  fi
  chmod +x "$3/bin/python"
  [ "${FAKE_VENV:-ok}" = ok ]; exit
fi
exit 1
"""


def bootstrap(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return subprocess.run(["bash", str(tmp_path / "scripts" / "bootstrap.sh")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHON": str(fake), **env})


def broken_venv(tmp_path: Path) -> None:
    """What a first run left where python3-venv was missing: a python, no pip."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("#!/usr/bin/env bash\nexit 1\n")
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_venv_without_pip_is_made_again(tmp_path: Path) -> None:
    """A re-run took the broken venv for done and failed in it for ever."""
    broken_venv(tmp_path)
    out = bootstrap(tmp_path)
    assert out.returncode == 0, out.stderr
    assert "-m pip install -q -e .[dev]" in (tmp_path / ".venv" / "calls").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_no_python3_venv_is_one_line_naming_the_package(tmp_path: Path) -> None:
    broken_venv(tmp_path)
    out = bootstrap(tmp_path, FAKE_VENV="no-pip")
    assert out.returncode == 2, out.stderr
    # The package of the Python asked for (python3-venv is the distribution's default one's).
    assert out.stderr.strip().endswith("install python3.12-venv (apt-get install python3.12-venv), then re-run"), \
        out.stderr
    assert not (tmp_path / ".venv").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_an_old_python_is_refused_before_anything_is_installed(tmp_path: Path) -> None:
    out = bootstrap(tmp_path, FAKE_VERSION="3.10")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"bootstrap: lanes needs Python >= 3.11; {tmp_path / 'python3'} is Python 3.10 (set PYTHON=python3.11 or newer)"]
    assert not (tmp_path / ".venv").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_working_venv_is_kept_whatever_python3_is_and_one_without_pip_gets_it(tmp_path: Path) -> None:
    """Installed with PYTHON=python3.11 where python3 is 3.10: a plain re-run (up.sh and test.sh
    run bootstrap at every start) was refused "needs Python >= 3.11" (re-review). A venv without
    pip (``uv venv``, ``--without-pip``) was deleted and rebuilt, torch and all: ensurepip first."""
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(
        '#!/usr/bin/env bash\nd=$(dirname "$0")/..\necho "$*" >> "$d/calls"\n'
        'if [ "$1 $2" = "-m pip" ] && [ ! -e "$d/has_pip" ]; then exit 1; fi\n'
        'if [ "$1 $2" = "-m ensurepip" ]; then touch "$d/has_pip"; fi\nexit 0\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / "kept").write_text("")
    out = bootstrap(tmp_path, FAKE_VERSION="3.10")
    assert out.returncode == 0, out.stderr
    assert (venv / "kept").exists() and (venv / "has_pip").exists(), "kept, pip added by ensurepip"
    assert "-m pip install -q -e .[dev]" in (venv / "calls").read_text()
