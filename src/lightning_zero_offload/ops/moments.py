"""Compact optimizer moments: the storage formats, their sizes, and conversions to and from fp32.

A rule's state is any number of named arrays (Adam: ``exp_avg`` and ``exp_avg_sq``; Lion:
``exp_avg``), each with its 8-bit code, given by the rule as ``{name: code}`` (``codes.SIGNED`` or
``codes.SQRT``); ``moment_dtype`` names how each is stored (master weights are always fp32):

- ``"fp32"``: fp32 arrays, exact (4 bytes per element and moment).
- ``"bf16"``: bf16 arrays (2 bytes per element and moment), written with stochastic rounding.
- ``"int8"``: one byte per element and moment plus one fp32 scale per block of ``BLOCK`` (256)
  elements and moment (1 + 4/256 bytes per element and moment). Block-wise quantization after
  Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022): each block is
  normalized by its absolute maximum, and the codes are non-linear so that small values survive.
  Ours are small floats relative to the block scale, cheap to encode in SIMD: a ``SIGNED`` array
  (a first moment) is sign + E4M3 (magnitudes from 2^-17 to 1.875 scales); a ``SQRT`` array (a
  second moment, never negative) is stored as its square root in unsigned E4M4 (2^-18 to 1.9375
  scales), so v keeps 32 binades. A block whose largest
  magnitude is 0 or below 2^-126 reads back 0. A non-finite value stays in its element, as in
  fp32 (torch's AdamW, lion_pytorch): its block is "marked" (the scale's sign bit set), scaled
  over its finite values to a top code of 1.75 (sqrt(v): 1.8125), and the codes above keep NaN,
  +inf and -inf (``ops.codes``); the other 255 elements keep their values within the code's
  bounds. A block stored with a NaN scale (before this) still reads back all NaN.

The kernel rounds the stored moments stochastically, from a counter-based hash of
``(rng_key(seed, step), offset + i)`` (array j takes 16 bits of it: ``codes.rounding_bits``):
round-to-nearest would freeze v, whose per-step change
(0.1% with beta2=0.999) is below half a unit of either compact format. Results do not depend on
threads, SIMD path or how a buffer is cut into calls (for ``"int8"`` the cuts must fall on block
boundaries: offsets that are multiples of ``BLOCK``). Conversions from fp32 (``Moments.from_fp32``,
for loading a ``torch.optim.AdamW`` state) round to nearest instead; ``to_fp32`` is exact.

Everything here is pure torch; the codes and rounding bits are ``ops.codes``'s, which the
reference kernels use too and the C++ kernel (``src/kernels/compact.h``) implements operation
for operation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_zero_offload.ops.codes import (
    BLOCK,
    SIGNED,
    SQRT,
    decode,
    encode,
    encode_bf16,
    half,
    num_blocks,
    random_bits,
    rng_key,
    word_key,
)

__all__ = [
    "BLOCK", "CODES", "MOMENT_DTYPES", "Moments", "SIGNED", "SQRT", "array_bytes", "moment_bytes",
    "num_blocks", "rng_key",
]

MOMENT_DTYPES = ("fp32", "bf16", "int8")
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
_NEAREST = 0x8000  # rounding bits that make the encoders round to nearest


def _check_dtype(moment_dtype: str) -> None:
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(
            f"moment_dtype={moment_dtype!r} is not supported; choose one of {MOMENT_DTYPES}"
        )


def moment_bytes(numel: int, moment_dtype: str, arrays: int) -> int:
    """Exact bytes of ``arrays`` state arrays (a rule's: Adam two, Lion one) for ``numel``
    elements, scales and a partial last block included (what ``Moments.zeros`` allocates)."""
    return arrays * array_bytes(numel, moment_dtype)


# --- the public container ----------------------------------------------------------------------

# How a state array is stored as 8-bit codes: sign + E4M3 of the value (a first moment), or
# unsigned E4M4 of its square root (a second moment, never negative). A rule gives each of its
# arrays one, as ``{name: code}``.
CODES = (SIGNED, SQRT)


def _state(names: Sequence[str] | Mapping[str, str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(names, codes)`` of a state given as ``{name: code}``, or as names alone (no codes:
    fp32 or bf16 only)."""
    codes = dict(names) if isinstance(names, Mapping) else {}
    bad = {n: c for n, c in codes.items() if c not in CODES}
    if bad:
        raise ValueError(f"Moments: unknown storage code for {bad}; known: {CODES}")
    return tuple(names), codes


def array_bytes(numel: int, moment_dtype: str) -> int:
    """Exact bytes of one state array of ``numel`` elements, its block scales included."""
    _check_dtype(moment_dtype)
    if numel < 0:
        raise ValueError(f"moment_bytes: numel must be >= 0, got {numel}")
    size = _STORAGE[moment_dtype].itemsize * numel
    return size + 4 * num_blocks(numel) if moment_dtype == "int8" else size


class Moments:
    """A rule's per-element state (any number of named arrays: Adam two, Lion one) of one flat
    buffer, or a chunk of one, in one storage format.

    ``names`` is the rule's state, ``{name: code}`` (torch's names, in the rule's order; the
    codes say how ``"int8"`` stores each: ``SIGNED``, ``SQRT``), or names alone where no codes
    are needed (fp32, bf16). ``arrays`` are fp32, bf16 or uint8 codes by name; ``scales`` (fp32,
    one per block) exist only for ``"int8"``. Each array is also an attribute by its name
    (``mom.exp_avg``, ``mom.exp_avg_scales``). ``offset`` is where this chunk starts in the whole
    buffer: the kernel's rounding counter, so a buffer updated chunk by chunk gives the same bits
    as in one call. Array j is rounded with half j % 2 of the element's random word j // 2
    (``codes.word_key``). Pass a chunk to a kernel with ``**moments.kernel_args()``.
    """

    def __init__(self, moment_dtype: str, *arrays: torch.Tensor,
                 names: Sequence[str] | Mapping[str, str],
                 scales: tuple[torch.Tensor, ...] = (), offset: int = 0,
                 numel: int = 0) -> None:
        names, codes = _state(names)
        if len(names) != len(arrays) or (scales and len(scales) != len(arrays)):
            raise ValueError(f"Moments: {len(arrays)} arrays and {len(scales)} scales for the "
                             f"state {names}")
        if moment_dtype == "int8" and len(codes) != len(names):
            raise ValueError(f"Moments: int8 state {names} needs each array's code "
                             f"({{name: code}}, codes {CODES})")
        self.moment_dtype, self.names, self.codes, self.offset = moment_dtype, names, codes, offset
        self.arrays = dict(zip(names, arrays, strict=True))
        self.scales = dict(zip(names, scales, strict=False))  # none unless int8
        self._numel = arrays[0].numel() if arrays else numel  # a state of no arrays has a size

    @property
    def state(self) -> Mapping[str, str] | tuple[str, ...]:
        """The ``names`` this state was made with (``{name: code}`` where it has codes)."""
        return self.codes or self.names

    def __getattr__(self, attr: str) -> torch.Tensor | None:
        arrays, scales = self.__dict__.get("arrays", {}), self.__dict__.get("scales", {})
        if attr in arrays:
            return arrays[attr]
        if attr.endswith("_scales") and attr.removesuffix("_scales") in arrays:
            return scales.get(attr.removesuffix("_scales"))
        raise AttributeError(attr)

    def _like(self, arrays: list[torch.Tensor], scales: list[torch.Tensor], offset: int,
              numel: int) -> Moments:
        return Moments(self.moment_dtype, *arrays, scales=tuple(scales), names=self.state,
                       offset=offset, numel=numel)

    def at(self, offset: int) -> Moments:
        """The same arrays as a chunk that starts at ``offset`` of the whole buffer."""
        return self._like(list(self.arrays.values()), list(self.scales.values()), offset,
                          self.numel)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields().values())

    @classmethod
    def zeros(cls, numel: int, moment_dtype: str, *, names: Mapping[str, str],
              pin_memory: bool = False) -> Moments:
        """Zero state (the rules' initial state) of ``names`` (``{name: code}``) for ``numel``
        elements; ``moment_bytes`` bytes."""
        _check_dtype(moment_dtype)
        dt = _STORAGE[moment_dtype]
        arrays = [torch.zeros(numel, dtype=dt, pin_memory=pin_memory) for _ in names]
        scales = ([torch.zeros(num_blocks(numel), pin_memory=pin_memory) for _ in names]
                  if moment_dtype == "int8" else [])
        return cls(moment_dtype, *arrays, scales=tuple(scales), names=names, numel=numel)

    @classmethod
    def from_fp32(cls, *args: Any, names: Mapping[str, str]) -> Moments:
        """``from_fp32(*fp32_arrays, moment_dtype, names=...)``: fp32 state (e.g. a
        ``torch.optim.AdamW`` state, flattened) converted to ``moment_dtype``, rounding to
        nearest. ``"fp32"`` copies. ``names``: ``{name: code}``, one per array, in order."""
        *given, moment_dtype = args
        _check_dtype(moment_dtype)
        codes, order = names, tuple(names)
        if len(given) != len(order):
            raise ValueError(f"Moments.from_fp32: {len(given)} arrays for the state {order}")
        flat = [_flat_fp32(t, n) for t, n in zip(given, order, strict=True)]
        if len({t.numel() for t in flat}) > 1:
            raise ValueError(" but ".join(f"{n} has {t.numel()} elements"
                                          for n, t in zip(order, flat, strict=True)))
        if moment_dtype == "fp32":
            return cls("fp32", *(t.clone() for t in flat), names=codes)
        if moment_dtype == "bf16":
            return cls("bf16", *(t.to(torch.bfloat16) for t in flat), names=codes)
        # 2**16 elements (whole blocks) at a time: the encoder's int64 temporaries take about
        # 150 bytes per element, so a bucket at once would peak far above the bucket itself
        n, step = (flat[0].numel() if flat else 0), 2**16
        out = [torch.empty(n, dtype=torch.uint8) for _ in flat]
        scales = [torch.empty(num_blocks(n)) for _ in flat]
        nearest = torch.full((min(n, step),), _NEAREST, dtype=torch.int64)
        for a in range(0, n, step):
            b, blocks = min(n, a + step), slice(a // BLOCK, num_blocks(min(n, a + step)))
            for x, c, s, name in zip(flat, out, scales, order, strict=True):
                c[a:b], s[blocks] = encode(x[a:b], codes[name], nearest[:b - a])
        return cls("int8", *out, scales=tuple(scales), names=codes)

    def to_fp32(self) -> tuple[torch.Tensor, ...]:
        """The state as fp32 arrays in the order of :attr:`names` (new tensors), exactly as the
        kernel reads them: the form of a torch optimizer's state."""
        if self.moment_dtype != "int8":
            return tuple(t.float().clone() for t in self.arrays.values())
        n, step = self.numel, 2**16  # whole blocks at a time, as from_fp32
        out = tuple(torch.empty(n) for _ in self.names)
        for a in range(0, n, step):
            b, blocks = min(n, a + step), slice(a // BLOCK, num_blocks(min(n, a + step)))
            for x, name in zip(out, self.names, strict=True):
                x[a:b] = decode(self.arrays[name][a:b], self.scales[name][blocks],
                                self.codes[name])
        return out

    def copy_(self, other: Moments) -> None:
        """Overwrite this state with ``other`` (same format, names and size), in place."""
        if (other.moment_dtype, other.names) != (self.moment_dtype, self.names) or (
                self.names and other.numel != self.numel):  # no arrays: no size to match
            raise ValueError(
                f"cannot copy {other.moment_dtype} state {other.names} of {other.numel} elements "
                f"into {self.moment_dtype} state {self.names} of {self.numel}; convert with "
                "to_fp32/from_fp32"
            )
        mine = self.fields()
        for key, t in other.fields().items():
            mine[key].copy_(t)

    def chunk(self, start: int, numel: int) -> Moments:
        """Views of elements ``[start, start + numel)``. For ``"int8"`` both ends must be block
        boundaries (multiples of ``BLOCK``), or the end must be the end of the buffer."""
        end = start + numel
        if not self.names and start >= 0 and numel >= 0:  # no arrays: any part of any size
            return self._like([], [], self.offset + start, numel)
        if start < 0 or numel < 0 or end > self.numel:
            raise ValueError(f"chunk [{start}, {end}) is outside moments of {self.numel}")
        arrays = [t[start:end] for t in self.arrays.values()]
        if self.moment_dtype != "int8":
            return self._like(arrays, [], self.offset + start, numel)
        if start % BLOCK or (end % BLOCK and end != self.numel):
            raise ValueError(
                f"int8 moments: chunk [{start}, {end}) does not fall on {BLOCK}-element block "
                f"boundaries; cut buffers at multiples of {BLOCK} elements (one scale per block)"
            )
        b0, b1 = start // BLOCK, num_blocks(end)
        return self._like(arrays, [s[b0:b1] for s in self.scales.values()], self.offset + start,
                          numel)

    def keep_prefix_(self, numel: int) -> None:
        """Keep elements ``[0, numel)`` only, in new smaller arrays, one array at a time: while
        it runs, memory holds the old arrays plus one new one (a whole new set would double it).
        For ``"int8"``, ``numel`` ends on a block boundary or the buffer's end (as ``chunk``)."""
        view = self.chunk(0, numel)
        for mine, views in ((self.arrays, view.arrays), (self.scales, view.scales)):
            for name in list(mine):
                mine[name] = views.pop(name).clone()  # the old storage goes with its last view
        self._numel = numel

    def round_from_(self, arrays32: tuple[torch.Tensor, ...], key: int) -> None:
        """Store fp32 arrays (in :attr:`names` order) into this state as the kernels do after
        a step: stochastically rounded with the bits of ``(key, offset + i)``, array j with half
        j % 2 of word j // 2 (``codes.word_key``); fp32 copies. A pure-torch kernel's store."""
        if self.moment_dtype == "fp32":
            for dst, x in zip(self.arrays.values(), arrays32, strict=True):
                dst.copy_(x)
            return
        words: dict[int, torch.Tensor] = {}
        for j, (name, x) in enumerate(zip(self.names, arrays32, strict=True)):
            if j // 2 not in words:  # one random word serves two arrays
                words[j // 2] = random_bits(word_key(key, j // 2), self.offset, self.numel)
            r16 = half(words[j // 2], j)
            if self.moment_dtype == "bf16":
                self.arrays[name].copy_(encode_bf16(x, r16))
            else:
                codes, scales = encode(x, self.codes[name], r16)
                self.arrays[name].copy_(codes)
                self.scales[name].copy_(scales)

    @classmethod
    def named(cls, moment_dtype: str, fields: Mapping[str, Any],
              names: Mapping[str, str]) -> Moments:
        """State ``names`` (``{name: code}``) from tensors keyed by torch's names (and, for int8,
        ``<name>_scales``), as a checkpoint stores them: :meth:`fields` read back."""
        scales = tuple(fields[f"{n}_scales"] for n in names) if moment_dtype == "int8" else ()
        return cls(moment_dtype, *(fields[n] for n in names), scales=scales, names=names)

    def fields(self) -> dict[str, torch.Tensor]:
        """The stored tensors by torch's names (the scales only where they exist)."""
        return {**self.arrays, **{f"{n}_scales": s for n, s in self.scales.items()}}

    def kernel_args(self) -> dict:
        """Keyword arguments of the rule's kernel (``ops.fused_adamw_``, ``ops.fused_lion_``)
        for this state: each array and its scales (None but for int8) by name, and ``offset``."""
        return {**self.arrays, **{f"{n}_scales": self.scales.get(n) for n in self.names},
                "offset": self.offset}


def _flat_fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    return t.detach().reshape(-1).cpu()
