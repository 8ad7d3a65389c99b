"""Build (once, cached) and load the C++ kernel, or choose the pure-torch reference.

``load()`` returns the extension module, or ``None`` when the reference is in use:

- ``LZO_KERNEL=reference``: the reference, no build. ``LZO_KERNEL=cpp``: the kernel or an error.
  Unset (or ``auto``): the kernel; without a C++ compiler, the reference with one warning.
- ``LZO_KERNEL_ISA=NAME``: the kernel's SIMD path, one of ``available_isas()`` on this CPU
  (``avx512bf16``, ``avx512``, ``avx2``, ``scalar``); unset, empty or ``auto``: the CPU's best.
  All paths give the same bits; this lets CI and users run every path without code changes.
- The build is cached under ``$LZO_BUILD_DIR`` (default ``~/.cache/lightning_zero_offload``) in a
  folder named by a key over the sources, torch version, flags and Python ABI, so a change to any
  of them builds afresh and a finished build loads without a compiler (``lzo-build`` prebuilds one
  for read-only homes).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

NAME = "lzo_kernels"
ENV_KERNEL = "LZO_KERNEL"
ENV_BUILD_DIR = "LZO_BUILD_DIR"
ENV_ISA = "LZO_KERNEL_ISA"
INSTALL_HINT = (
    "Install a C++17 compiler (Debian/Ubuntu: `apt install g++`; RHEL: `dnf install gcc-c++`; "
    "conda: `conda install -c conda-forge gxx`; macOS: `xcode-select --install`), or set "
    f"{ENV_KERNEL}=reference to use the slower pure-torch kernel."
)

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_ext: ModuleType | None = None
_warned_no_compiler = False


def source_dir() -> Path:
    """The C++ sources: ``lightning_zero_offload/kernels`` (wheel) or ``src/kernels`` (checkout)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "kernels", here.parent.parent / "kernels"):
        if (cand / "bindings.cpp").is_file():
            return cand
    raise RuntimeError(f"lightning-zero-offload: C++ kernel sources not found next to {here}")


def sources(src: Path | None = None) -> list[Path]:
    return sorted((src or source_dir()).glob("*.cpp"))


def _torch_uses_libgomp() -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps


def _openmp() -> list[str]:
    # OpenMP lets the kernel run on torch's own intra-op pool (at::parallel_for). Only where the
    # loaded torch runs on GNU OpenMP (pip wheels ship libgomp.so.1 and load it first): our
    # reference to that soname then binds to torch's runtime, one pool in the process. Under
    # another runtime (Intel's libiomp5 in some conda builds) a second one would compete, so the
    # kernel keeps its own pool there.
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available() and (
        _torch_uses_libgomp()
    ):
        return ["-fopenmp"]
    return []


def cflags() -> list[str]:
    # No -march: SIMD paths are chosen at run time. No fp contraction: every path rounds alike.
    return ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden",
            *_openmp()]


def ldflags() -> list[str]:
    return ["-pthread", *_openmp()] if sys.platform.startswith("linux") else []


def build_root() -> Path:
    root = os.environ.get(ENV_BUILD_DIR)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "lightning_zero_offload"


def cache_key(src: Path | None = None) -> str:
    """Hash of everything the binary depends on: sources, torch, flags, Python ABI, platform."""
    src = src or source_dir()
    h = hashlib.sha256()
    for f in sorted(src.glob("*.cpp")) + sorted(src.glob("*.h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for part in (
        torch.__version__,
        " ".join(cflags() + ldflags()),
        sys.implementation.cache_tag,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        platform.machine(),
    ):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def find_compiler() -> str | None:
    """The C++ compiler a build would use (``$CXX``, else ``c++``), or None when there is none."""
    cxx = os.environ.get("CXX", "c++").split()
    return shutil.which(cxx[0]) if cxx else None


def module_name(build_dir: Path) -> str:
    """One module name per cache key (torch's JIT loader renames a reused name to ``_v1``...)."""
    return f"{NAME}_{build_dir.name}"


def _import_built(build_dir: Path) -> ModuleType | None:
    """Load a finished build without touching the (possibly read-only) folder; None if absent."""
    name = module_name(build_dir)
    so = build_dir / f"{name}.so"
    if not so.is_file():
        return None
    loader = importlib.machinery.ExtensionFileLoader(name, str(so))
    spec = importlib.util.spec_from_file_location(name, so, loader=loader)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError:
        return None  # a half-written build: build again
    return module


def build(build_dir: Path, src: Path | None = None, *, verbose: bool = False) -> ModuleType:
    """Compile into ``build_dir`` (or load what is there) and return the module."""
    from torch.utils import cpp_extension

    module = _import_built(build_dir)
    if module is not None:
        logger.debug("kernel: loaded the build in %s", build_dir)
        return module
    build_dir.mkdir(parents=True, exist_ok=True)
    # The compile takes about a minute (60-90 s on 2 cores) and torch's loader says nothing
    # (verbose=False): say why we pause.
    print("lightning-zero-offload: building the CPU optimizer kernel (first use, about a minute) "
          f"in {build_dir}...", file=sys.stderr, flush=True)
    env_path = os.environ.get("PATH", "")
    # ninja is a dependency; make the venv's copy visible even when the venv is not activated.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env_path])
    logger.debug("kernel: compiling %s with %s", build_dir, " ".join(cflags()))
    try:
        built = cpp_extension.load(  # a module (is_python_module defaults to True)
            name=module_name(build_dir),
            sources=[str(s) for s in sources(src)],
            extra_cflags=cflags(),
            extra_ldflags=ldflags(),
            build_directory=str(build_dir),
            verbose=verbose,
        )
        assert isinstance(built, ModuleType)
        logger.debug("kernel: built in %s", build_dir)
        return built
    except Exception as e:  # noqa: BLE001 - re-raised with the compiler output and a remedy
        raise RuntimeError(
            "lightning-zero-offload: building the C++ CPU optimizer kernel in "
            f"{build_dir} failed.\n{e}\n{INSTALL_HINT}"
        ) from e
    finally:
        os.environ["PATH"] = env_path


def select_isa(module: ModuleType) -> None:
    """Set the SIMD path ``$LZO_KERNEL_ISA`` names (nothing when unset, empty or ``auto``)."""
    name = os.environ.get(ENV_ISA, "").strip().lower()
    if name in ("", "auto"):
        return
    available = list(module.available_isas())
    if name not in available:
        # set_isa refuses too, but its message does not name the variable the user set.
        raise RuntimeError(
            f"{ENV_ISA}={name!r}: this CPU's kernel has no such SIMD path; available here (best "
            f"first): {', '.join(available)}. Set one of them, or unset it (or 'auto') for the "
            "best."
        )
    module.set_isa(name)


def load() -> ModuleType | None:
    """The extension (built on first use), or None when the reference is in use."""
    global _ext, _warned_no_compiler
    mode = os.environ.get(ENV_KERNEL, "auto").strip().lower() or "auto"
    if mode == "reference":
        return None
    if mode not in ("auto", "cpp"):
        raise ValueError(f"{ENV_KERNEL}={mode!r}: expected 'cpp', 'reference' or 'auto'")
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        build_dir = build_root() / cache_key()
        module = _import_built(build_dir)
        logger.debug("kernel: %s in %s", "found a build" if module else "no build yet", build_dir)
        if module is None and find_compiler() is None:
            if mode == "cpp":
                raise RuntimeError(
                    f"lightning-zero-offload: {ENV_KERNEL}=cpp but no C++ compiler was found "
                    f"(looked for {os.environ.get('CXX', 'c++')!r}). {INSTALL_HINT}"
                )
            if not _warned_no_compiler:
                _warned_no_compiler = True
                warnings.warn(
                    "lightning-zero-offload: no C++ compiler found, so the CPU optimizer step uses "
                    "the pure-torch reference (same results, several times slower). "
                    f"{INSTALL_HINT}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        module = module if module is not None else build(build_dir)
        select_isa(module)  # before publishing it: a bad value raises on every load
        _ext = module
        return _ext


def main(argv: list[str] | None = None) -> int:
    """``lzo-build [DIR]``: prebuild the kernel into DIR (for clusters with read-only homes)."""
    parser = argparse.ArgumentParser(
        prog="lzo-build",
        description="Prebuild the lightning-zero-offload C++ kernel into DIR, e.g. on a shared "
        f"file system for clusters with read-only homes; then set {ENV_BUILD_DIR}=DIR.",
    )
    parser.add_argument("dir", nargs="?", type=Path, default=None,
                        help=f"build root (default: ${ENV_BUILD_DIR} or ~/.cache/...)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    root = (args.dir or build_root()).expanduser().resolve()
    build_dir = root / cache_key()
    module = build(build_dir, verbose=args.verbose)
    print(f"Built the lightning-zero-offload kernel in {build_dir}")
    print(f"SIMD paths on this CPU: {', '.join(module.available_isas())}")
    print(f"Use it with: export {ENV_BUILD_DIR}={root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
