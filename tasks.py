#!/usr/bin/env python3
"""The README's two commands: ``python3 tasks.py train`` and ``python3 tasks.py test``.

Each creates ``.venv`` next to this file on first use and installs what it needs into it, so a
fresh clone needs nothing but Python, network access to PyPI on the first call, and a C++
compiler for the CPU Adam kernel (built on first use). Torch is pinned here to ``torch==2.13.0``
from whatever index pip uses (from PyPI on Linux that is the CUDA build); ``LZO_TORCH`` overrides
the pin and may carry pip options, e.g. ``LZO_TORCH="torch==2.13.0 --index-url
https://download.pytorch.org/whl/cpu"`` for the CPU-only build. The package itself only asks for
a range.
"""

from __future__ import annotations

import hashlib
import os
import shlex
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


def torch_args() -> list[str]:
    """pip arguments for torch: the pin, or ``LZO_TORCH`` split like a shell would."""
    args = shlex.split(TORCH)
    if not args:
        raise SystemExit("LZO_TORCH is empty: unset it, or give a pip requirement such as "
                         "'torch==2.13.0'")
    return args


def ensure_venv() -> Path:
    """Create the venv and install torch plus this package with its extras (``all``: the
    Lightning, Accelerate, transformers, TRL/PEFT and plot extras; not torchao) and the dev
    tools, once per pyproject and torch pin."""
    py = _python()
    if not py.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp_key = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    stamp = VENV / f".installed-{stamp_key[:16]}"
    if not stamp.exists():
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run(*pip, "--upgrade", "pip")
        _run(*pip, *torch_args())
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
