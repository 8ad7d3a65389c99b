#!/usr/bin/env python3
"""The README's two commands: ``python3 tasks.py train`` and ``python3 tasks.py test``.

Each creates ``.venv`` next to this file on first use and installs what it needs into it, so a
fresh clone needs nothing but Python. Torch is pinned here (``LZO_TORCH`` overrides the pin, for
example with a CUDA build on a GPU machine); the package itself only asks for a range.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH = os.environ.get("LZO_TORCH", "torch==2.13.0")


def _python() -> Path:
    return VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _run(*cmd: object) -> None:
    subprocess.run([str(c) for c in cmd], cwd=ROOT, check=True)


def ensure_venv() -> Path:
    """Create the venv and install torch plus this package with every extra, once per pyproject."""
    py = _python()
    if not py.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp_key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    stamp = VENV / f".installed-{stamp_key[:16]}"
    if not stamp.exists():
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run(*pip, "--upgrade", "pip")
        _run(*pip, TORCH)
        _run(*pip, "-e", ".[all,dev]")
        stamp.touch()
    return py


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("train", "test"):
        print(__doc__)
        return 2
    py = ensure_venv()
    if argv[0] == "train":
        cmd = [py, "examples/lightning_gpt.py", *argv[1:]]
    else:
        _run(py, "-m", "ruff", "check", "src", "tests", "examples", "benchmarks", "tasks.py")
        _run(py, "-m", "pyright", "--pythonpath", py)  # [tool.pyright] in pyproject.toml
        cmd = [py, "-m", "pytest", *argv[1:]]
    return subprocess.run([str(c) for c in cmd], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
