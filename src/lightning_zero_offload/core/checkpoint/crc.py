"""The checkpoint checksum: a CRC-32 over a canonical walk of a checkpoint's content.

Tensors count by dtype, shape and bytes, plain values by repr, other objects by type only (their
repr may hold addresses). A tensor's bytes are CRC'd on their own, on threads (``zlib.crc32``
releases the GIL) or while the file is written, and folded into the walk with
:func:`crc32_combine`, so the walk's order never decides the order the bytes are read in.
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

CHECKSUM_KEY = "zero_offload_checksum"
_CHUNK = 64 * 2**20  # bytes one thread CRCs at a time


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _zero_operators() -> list[list[int]]:
    """``ops[k]``: the GF(2) matrix that appends ``2**k`` zero bytes to a CRC-32 register."""
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    op = one_bit
    for _ in range(3):  # one zero byte = eight zero bits
        op = [_gf2_times(op, op[n]) for n in range(32)]
    ops = [op]
    for _ in range(63):
        ops.append([_gf2_times(ops[-1], ops[-1][n]) for n in range(32)])
    return ops


_OPS = _zero_operators()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)`` (zlib's
    ``crc32_combine``, which Python's zlib does not expose)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_times(_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def tensor_bytes(t: Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


class Threads:
    """A few threads that take CRCs (``zlib.crc32`` releases the GIL), as a context manager.

    Not ``concurrent.futures``' pool: that one refuses new work once the main thread has ended,
    and an asynchronous save the script did not wait for is written exactly then (the
    interpreter waits for its thread before it exits)."""

    def __init__(self, n: int) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        for _ in range(max(1, n)):
            t = threading.Thread(target=self._work, name="zero-offload-crc", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no new threads at exit (CPython 3.12.0/1): CRCs done inline
                break
            self._threads.append(t)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            done, data = job
            try:
                done.set_result(zlib.crc32(data))
            except BaseException as e:  # raised where the result is asked for
                done.set_exception(e)

    def crc(self, data: memoryview) -> Future:
        """The CRC-32 of ``data``, taken on one of the threads."""
        done: Future = Future()
        if self._threads:
            self._jobs.put((done, data))
        else:
            done.set_result(zlib.crc32(data))
        return done

    def __enter__(self) -> Threads:
        return self

    def __exit__(self, *exc: object) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()


def crc_started(data: memoryview, pool: Threads) -> Callable[[], int]:
    """Start the CRC-32 of ``data`` on ``pool``'s threads, a chunk each; the returned call
    waits for it."""
    parts = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [data]
    jobs = [pool.crc(part) for part in parts]

    def result() -> int:
        crc = 0
        for part, job in zip(parts, jobs, strict=True):
            crc = crc32_combine(crc, job.result(), len(part))
        return crc

    return result


def bytes_crc(data: memoryview, pool: Threads | None = None) -> int:
    """CRC-32 of ``data``; with ``pool``, chunks on its threads, combined."""
    return zlib.crc32(data) if pool is None else crc_started(data, pool)()


def _host(t: Tensor) -> Tensor:
    return t.detach().cpu().contiguous()


def _header(dtype: torch.dtype, shape: Iterable[int]) -> bytes:
    return f"T{dtype}{tuple(shape)}".encode()


def walk(obj: Any, crc: int, data_crc: Callable[[Any], int]) -> int:
    """CRC-32 of the canonical walk of ``obj``; a tensor's (or a stand-in's, see
    ``stream.Later``) bytes come from ``data_crc(t)``, over ``t.nbytes`` bytes."""
    if isinstance(obj, Tensor) or hasattr(obj, "later_of"):
        crc = zlib.crc32(_header(obj.dtype, obj.shape), crc)
        nbytes = obj.numel() * obj.element_size()
        return crc32_combine(crc, data_crc(obj), nbytes) if nbytes else crc
    if isinstance(obj, Mapping):
        crc = zlib.crc32(f"D{len(obj)}".encode(), crc)
        for key in sorted(obj, key=repr):
            crc = walk(obj[key], walk(key, crc, data_crc), data_crc)
        return crc
    if isinstance(obj, (list, tuple)):
        crc = zlib.crc32(f"L{len(obj)}".encode(), crc)
        for item in obj:
            crc = walk(item, crc, data_crc)
        return crc
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype)):
        return zlib.crc32(f"{type(obj).__name__}:{obj!r}".encode(), crc)
    return zlib.crc32(f"O{type(obj).__qualname__}".encode(), crc)


def find(obj: Any, kind: type | tuple[type, ...]) -> list:
    """Every object of ``kind`` in ``obj`` (nested dicts, lists, tuples), once each, in walk
    order."""
    found: dict[int, Any] = {}

    def visit(o: Any) -> None:
        if isinstance(o, kind):
            found.setdefault(id(o), o)
        elif isinstance(o, Mapping):
            for key in o:
                visit(key)
                visit(o[key])
        elif isinstance(o, (list, tuple)):
            for item in o:
                visit(item)

    visit(obj)
    return list(found.values())


def tensors(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj``, once each, in walk order."""
    return find(obj, Tensor)


def format_crc(crc: int) -> str:
    return f"crc32:{crc:08x}"


def checksum(obj: Mapping, threads: int = 2) -> str:
    """The checksum stored under :data:`CHECKSUM_KEY` (computed without that entry); tensors'
    bytes on ``threads`` threads (memory-mapped ones are read from the file as they go)."""
    content = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
    with Threads(threads) as pool:
        crcs = {id(t): bytes_crc(tensor_bytes(_host(t)), pool) if t.numel() else 0
                for t in tensors(content)}
    return format_crc(walk(content, 0, lambda t: crcs[id(t)]))
