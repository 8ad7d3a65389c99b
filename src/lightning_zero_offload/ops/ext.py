"""The compiled extension as every rule's kernel face uses it: whether it is in use, its SIMD
path, the threads a call runs on, and the argument checks.

Threads: called from the main thread with torch's thread count, a kernel runs on torch's own
intra-op pool (whose workers are still spinning after the last torch op, so waking other threads
would only compete with them); from any other thread (the delayed-update worker) it uses its own
pool. Results are bit-identical either way.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType

import torch

from lightning_zero_offload.ops import _build


def backend() -> str:
    """``"cpp"`` when the compiled kernel is in use, ``"reference"`` otherwise."""
    return "cpp" if _build.load() is not None else "reference"


def available_isas() -> list[str]:
    """SIMD paths of the compiled kernel on this CPU, best first (empty with the reference)."""
    ext = _build.load()
    return [] if ext is None else list(ext.available_isas())


def get_isa() -> str:
    """The SIMD path in use: ``"avx512"``, ``"avx2"``, ``"scalar"`` or ``"reference"``."""
    ext = _build.load()
    return "reference" if ext is None else ext.get_isa()


@contextlib.contextmanager
def force_isa(name: str) -> Iterator[None]:
    """Use one SIMD path inside the block (process-wide; for tests and benchmarks).

    All paths give bit-identical results; this exists to prove that and to measure them. For a
    whole process (CI runs the numeric tests on each path), set ``LZO_KERNEL_ISA`` instead.
    """
    ext = _build.load()
    if ext is None:
        raise RuntimeError("force_isa: the C++ kernel is not in use (pure-torch reference backend)")
    previous = ext.get_isa()
    ext.set_isa(name)  # RuntimeError naming the available paths if this CPU lacks `name`
    try:
        yield
    finally:
        ext.set_isa(previous)


def check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None,
                 fn: str) -> None:
    """``t`` (argument ``name`` of kernel ``fn``) is a dense contiguous CPU tensor of one of
    ``dtypes`` (and ``numel`` elements); else a clear error naming the fix."""
    # Ordered cheapest-first: this runs once per tensor per call, and calls come chunk by chunk.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(
            f"{fn}: `{name}` is on {t.device}; the CPU optimizer needs host tensors "
            f"(move it with `.cpu()`)"
        )
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: `{name}` has dtype {t.dtype}; expected one of: {names}")
    if t.layout is not torch.strided:
        raise ValueError(f"{fn}: `{name}` must be a dense (strided) tensor")
    if not t.is_contiguous():
        raise ValueError(f"{fn}: `{name}` must be contiguous (call `.contiguous()`)")
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"{fn}: `{name}` has {t.numel()} elements but `param` has {numel}"
        )


def kernel() -> ModuleType | None:
    """The compiled extension, or None where the pure-torch reference is in use."""
    return _build.load()


def pool(num_threads: int | None) -> tuple[int, bool]:
    """``(threads, on torch's pool)`` of a kernel call: ``num_threads`` (default torch's), and
    whether the chunks may run on torch's intra-op pool (torch's count, the main thread)."""
    if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
        raise ValueError(f"`num_threads` must be an int >= 1, got {num_threads!r}")
    torch_threads = torch.get_num_threads()
    threads = int(num_threads or torch_threads)
    return threads, (threads == torch_threads
                     and threading.current_thread() is threading.main_thread())
