"""Checkpoint files written a tensor at a time, with no second copy of the state.

A consolidated checkpoint holds the whole model's fp32 weights and moments, which the engine
keeps only as shards (other ranks' too, compact moments, the device part). Building that dict
would hold the optimizer state twice; instead its tensors are :class:`Later` stand-ins, each
made just before it is written (a view of the engine's arrays where dtype and layout allow) and
dropped after. The file is what ``torch.save`` writes (a zip of one 64-byte-aligned record per
tensor, plus ``data.pkl``), so ``torch.load(weights_only=True, mmap=True)`` reads it. The
checksum (``crc``'s) is taken on other threads while each record is written and combined in the
walk's order, so every byte is read once. ``data.pkl`` goes last: it holds the checksum.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._utils as torch_utils
from torch import Tensor

from lightning_zero_offload.core.checkpoint import crc

_SEQ = itertools.count()


class Later:
    """A tensor of ``shape`` and ``dtype`` that ``make()`` returns when it is written (a
    collective where the engine gathers it: every rank makes the same ones, in one order), or
    an iterable of flat pieces that are its elements back to back, made one at a time."""

    later_of = True  # what ``crc.walk`` and the pickler recognise

    def __init__(self, shape: Sequence[int], dtype: torch.dtype,
                 make: Callable[[], Tensor | Iterable[Tensor]]) -> None:
        self.shape, self.dtype, self.make = torch.Size(shape), dtype, make
        self.seq = next(_SEQ)  # stand-ins are made in the order they were created

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def __repr__(self) -> str:
        return f"Later({tuple(self.shape)}, {self.dtype})"


def laters(obj: Any) -> list[Later]:
    """Every :class:`Later` in ``obj``, once each, in the order they are to be made."""
    return sorted(crc.find(obj, Later), key=lambda x: x.seq)


def made(x: Tensor | Later) -> Tensor:
    """``x``, or what the stand-in ``x`` makes (its pieces joined)."""
    if not isinstance(x, Later):
        return x
    out = x.make()
    return out if isinstance(out, Tensor) else torch.cat(list(out)).view(x.shape)


def materialize(obj: Any, *, clone_tensors: bool = False,
                into: list[Tensor] | None = None) -> Any:
    """``obj`` with every :class:`Later` made (in order: collective where they gather) into
    memory of its own: what ``full_state_dict`` returns, at the cost of the copy this module
    avoids. ``clone_tensors``: its tensors cloned too (a snapshot of ``obj``); ``into``: the
    buffers of an earlier snapshot, reused where shape and dtype match (no page faults: a copy
    into them runs at the memory's speed), then replaced by this snapshot's."""
    reuse, used = list(into or []), []

    def own(shape: torch.Size, dtype: torch.dtype, pieces: Iterable[Tensor]) -> Tensor:
        i, buf = len(used), None
        if i < len(reuse) and reuse[i].shape == shape and reuse[i].dtype == dtype:
            buf = reuse[i]
        if buf is None:
            buf = torch.empty(shape, dtype=dtype)
        flat, at = buf.view(-1), 0
        for piece in pieces:
            flat[at : at + piece.numel()].copy_(piece.reshape(-1))
            at += piece.numel()
        used.append(buf)
        return buf

    def pieces(x: Later) -> Iterable[Tensor]:
        out = x.make()
        return [out] if isinstance(out, Tensor) else out

    made_ = {id(x): own(x.shape, x.dtype, pieces(x)) for x in laters(obj)}

    def sub(o: Any) -> Any:
        if isinstance(o, Later):
            return made_[id(o)]
        if isinstance(o, Tensor):
            return own(o.shape, o.dtype, [o.detach()]) if clone_tensors else o
        if isinstance(o, Mapping):
            return {k: sub(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(sub(v) for v in o)
        return o

    out = sub(obj)
    if into is not None:
        into[:] = used
    return out


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int, location: str) -> None:
        self.key, self.dtype, self.numel, self.location = key, dtype, numel, location


_STORAGE_TYPES = torch.storage._dtype_to_storage_type_map()  # dtype -> "FloatStorage", ...


class _Pickler(pickle.Pickler):
    """Pickles tensors and stand-ins as ``torch.save`` does: a rebuild call over a storage
    record, named by its key."""

    def __init__(self, file: Any, keys: dict[int, str], places: dict[int, str]) -> None:
        super().__init__(file, protocol=2)
        self.keys, self.places = keys, places

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, (Tensor, Later)):
            return NotImplemented
        shape = tuple(obj.shape)
        ref = _StorageRef(self.keys[id(obj)], obj.dtype, obj.numel(), self.places[id(obj)])
        rebuild = torch_utils._rebuild_tensor_v2
        return rebuild, (ref, 0, shape, _contiguous(shape), False, OrderedDict())

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            kind = getattr(torch, _STORAGE_TYPES[obj.dtype])
            return ("storage", kind, obj.key, obj.location, obj.numel)
        return None


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def make_all(obj: Any) -> None:
    """What a rank that does not write does: make every stand-in of ``obj`` in order (its part
    of the gathers) and drop it."""
    for later in laters(obj):
        out = later.make()
        if not isinstance(out, Tensor):
            for _ in out:
                pass


def write(obj: Mapping, path: Path) -> None:
    """``obj`` plus its checksum (``crc.CHECKSUM_KEY``) as a ``torch.save`` file at ``path``,
    fsynced: the stand-ins first, made in order, then ``obj``'s tensors, each written as its
    own contiguous bytes (on the host; the file keeps their device for ``torch.load``). If a
    write fails, the remaining stand-ins are still made (peers gather with this rank), then the
    error is raised; the archive writer is always finished here, never left to its destructor."""
    content = {k: v for k, v in obj.items() if k != crc.CHECKSUM_KEY}
    items: list[Any] = laters(content)
    items += crc.tensors(content)
    keys = {id(x): str(i) for i, x in enumerate(items)}
    places = {id(x): "cpu" if isinstance(x, Later) else
              torch.serialization.location_tag(x.untyped_storage()) for x in items}
    crcs: dict[int, int] = {}
    with open(path, "wb") as raw, crc.Threads(_CRC_THREADS) as pool:
        f = _Sink(raw)
        # torch's own zip CRC would read every byte once more: ours is the file's check
        zf = torch._C.PyTorchFileWriter(f, False, 64)  # type: ignore[call-overload]
        try:
            for i, x in enumerate(items):
                try:
                    crcs[id(x)] = _record(zf, f, f"data/{keys[id(x)]}", x, pool)
                    f.check()
                except OSError:
                    make_all(items[i + 1 :])
                    raise
            checksum = crc.format_crc(crc.walk(content, 0, lambda t: crcs[id(t)]))
            pickled = _pickle({**content, crc.CHECKSUM_KEY: checksum}, keys, places)
            zf.write_record("data.pkl", pickled, len(pickled))
            for name, value in ((".format_version", b"1"), (".storage_alignment", b"64"),
                                ("byteorder", sys.byteorder.encode())):  # as torch.save writes
                zf.write_record(name, value, len(value))
            zf.write_end_of_file()
            f.check()
            raw.flush()
            os.fsync(raw.fileno())
        except BaseException:
            # Finished now into nothing: left to its destructor, the writer would finish the
            # archive on a failed (or closed) file, and an error there aborts the process.
            f.failed()
            with contextlib.suppress(Exception):
                zf.write_end_of_file()
            raise
        finally:
            del zf  # (a traceback may still hold it: finished above, its destructor writes nothing)


class _Sink:
    """The file as torch's archive writer sees it. An OS error is kept here, not raised into
    the writer (raised through it, it leaves the writer's idea of the position behind the
    file's, and the writer cannot finish); from then on bytes are counted, not written, and
    :meth:`check` raises the error."""

    def __init__(self, f: Any) -> None:
        self._f, self._pos, self.error = f, 0, None
        self._dropping = False

    def failed(self) -> None:
        """Drop whatever is written from now on."""
        self._dropping = True

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def _do(self, op: Callable[[], object]) -> None:
        if self._dropping:
            return
        try:
            op()
        except OSError as e:
            self.error, self._dropping = e, True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self._do(lambda: self._f.write(data))
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._do(lambda: self._f.seek(offset, whence))
        self._pos = offset if whence == os.SEEK_SET else self._pos + offset  # no SEEK_END here
        return self._pos

    def tell(self) -> int:
        return self._pos


def _record(zf: Any, f: _Sink, name: str, x: Tensor | Later, pool: crc.Threads) -> int:
    """Write ``x`` as record ``name``; its bytes' CRC-32 (taken on ``pool`` meanwhile)."""
    out = x.make() if isinstance(x, Later) else x
    if isinstance(out, Tensor):
        data = _host(out, x)
        if tuple(data.shape) != tuple(x.shape):
            raise RuntimeError(f"checkpoint: {x!r} was made as {tuple(data.shape)}")
        job = crc.crc_started(crc.tensor_bytes(data), pool) if data.numel() else None
        zf.write_record(name, _storage(data), data.nbytes)  # type: ignore[arg-type]
        return job() if job is not None else 0
    # pieces: the record's room first, then each piece written into it as it is made
    nbytes = x.numel() * x.element_size()
    zf.write_record_metadata(name, nbytes)
    end = f.tell()
    f.seek(end - _DESCRIPTOR - nbytes)
    total, value = 0, 0
    for piece in out:
        data = _host(piece, x)
        job = crc.crc_started(crc.tensor_bytes(data), pool)
        f.write(crc.tensor_bytes(data))
        value = crc.crc32_combine(value, job(), data.nbytes)
        total += data.nbytes
    f.seek(end)
    if total != nbytes:
        raise RuntimeError(f"checkpoint: {x!r} was made of {total} bytes, not {nbytes}")
    return value


_DESCRIPTOR = 16  # the zip data descriptor the writer puts after a record's data
_CRC_THREADS = max(1, min(4, (os.cpu_count() or 1)))  # zlib.crc32 releases the GIL


def _host(t: Tensor, x: Tensor | Later) -> Tensor:
    data = t.detach().cpu().contiguous()
    if data.dtype != x.dtype:
        raise RuntimeError(f"checkpoint: {x!r} was made as {data.dtype}")
    return data


def _storage(t: Tensor) -> torch.UntypedStorage:
    """The bytes of contiguous ``t`` as a storage of their own (a view, not a copy)."""
    whole, start = t.untyped_storage(), t.storage_offset() * t.element_size()
    if start == 0 and whole.nbytes() == t.nbytes:
        return whole
    return whole[start : start + t.nbytes]


def _pickle(obj: Any, keys: dict[int, str], places: dict[int, str]) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, keys, places).dump(obj)
    return buf.getvalue()
