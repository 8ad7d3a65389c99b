"""Compact Adam moments: the storage formats, their sizes, and conversions to and from fp32.

``moment_dtype`` names how both moments are stored (master weights are always fp32):

- ``"fp32"``: two fp32 arrays, exact AdamW (8 bytes per element).
- ``"bf16"``: two bf16 arrays (4 bytes per element), written with stochastic rounding.
- ``"int8"``: one byte per element per moment plus one fp32 scale per block of ``BLOCK`` (256)
  elements and moment (2 + 8/256 bytes per element). Block-wise quantization after Dettmers et
  al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022): each block is normalized by
  its absolute maximum, and the codes are non-linear so that small values survive. Ours are small
  floats relative to the block scale, cheap to encode in SIMD: ``exp_avg`` is sign + E4M3
  (magnitudes from 2^-17 to 1.875 scales); ``exp_avg_sq`` is stored as its square root in
  unsigned E4M4 (2^-18 to 1.9375 scales), so v keeps 32 binades. A block holding a non-finite
  value stores scale NaN and reads back all NaN; a block whose largest magnitude is 0 or below
  2^-126 reads back 0.

The kernel rounds the stored moments stochastically, from a counter-based hash of
``(rng_key(seed, step), offset + i)``: round-to-nearest would freeze v, whose per-step change
(0.1% with beta2=0.999) is below half a unit of either compact format. Results do not depend on
threads, SIMD path or how a buffer is cut into calls (for ``"int8"`` the cuts must fall on block
boundaries: offsets that are multiples of ``BLOCK``). Conversions from fp32 (``Moments.from_fp32``,
for loading a ``torch.optim.AdamW`` state) round to nearest instead; ``to_fp32`` is exact.

Everything here is pure torch; ``_reference`` uses the same encoders, and the C++ kernel
(``src/kernels/compact.h``) implements them operation for operation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "BLOCK", "MOMENT_DTYPES", "Moments", "moment_bytes", "num_blocks", "rng_key",
]

BLOCK = 256
MOMENT_DTYPES = ("fp32", "bf16", "int8")
_STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
_MASK = 0xFFFFFFFF
_MAX_M = 1.875  # largest E4M3 magnitude
_MAX_S = 1.9375  # largest E4M4 value
_NEAREST = 0x8000  # rounding bits that make the encoders round to nearest


def _check_dtype(moment_dtype: str) -> None:
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(
            f"moment_dtype={moment_dtype!r} is not supported; choose one of {MOMENT_DTYPES}"
        )


def num_blocks(numel: int) -> int:
    """Number of 8-bit blocks (and scales per moment) for ``numel`` elements."""
    return -(-numel // BLOCK)


def moment_bytes(numel: int, moment_dtype: str) -> int:
    """Exact bytes of both moments for ``numel`` elements, scales and a partial last block
    included (what ``Moments.zeros`` allocates)."""
    _check_dtype(moment_dtype)
    if numel < 0:
        raise ValueError(f"moment_bytes: numel must be >= 0, got {numel}")
    if moment_dtype == "fp32":
        return 8 * numel
    if moment_dtype == "bf16":
        return 4 * numel
    return 2 * numel + 2 * 4 * num_blocks(numel)


# --- 32-bit integer helpers on int64 tensors (exact, mod 2^32) --------------------------------


def _hash32_int(x: int) -> int:
    x &= _MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK
    return x ^ (x >> 16)


def rng_key(seed: int, step: int) -> int:
    """The 32-bit stochastic-rounding key of one step (a new stream every step and seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    k = _hash32_int(seed ^ 0x9E3779B9)
    k = _hash32_int(k ^ (seed >> 32))
    k = _hash32_int(k ^ step)
    return _hash32_int(k ^ (step >> 32))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 without overflowing int64: split c into 16-bit halves.
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # The kernel's per-element hash (compact.h, hash_v): a bijection of 32 bits.
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(key: int, offset: int, numel: int) -> torch.Tensor:
    """The kernel's 32 random bits of elements ``offset .. offset + numel - 1`` (int64): the
    hash of ``(index + key) mod 2^32``."""
    idx = (torch.arange(numel, dtype=torch.int64) + offset + key) & _MASK
    return _hash32(idx)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32).to(torch.int64) & _MASK


def _float(bits: torch.Tensor) -> torch.Tensor:
    b = bits & _MASK
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


# --- the codes ---------------------------------------------------------------------------------


def _enc_mag(x: torch.Tensor, r16: torch.Tensor, mb: int) -> torch.Tensor:
    """|x| (float32, in block-scale units) -> E4M{mb} code, rounding bits r16 in [0, 2^16).

    Below 2^-14 x is shifted up by 2^-14 into the lowest binade (whose grid is the subnormal
    step), rounded there, and shifted back by 2^mb codes."""
    ax = _bits(x) & 0x7FFFFFFF
    sub = ax < (113 << 23)
    xa = _float(ax)
    y = torch.where(sub, xa + torch.full_like(xa, 2.0**-14), xa)
    q = ((_bits(y) + (r16 << (7 - mb))) >> (23 - mb)) - torch.where(
        sub, (112 << mb) + (1 << mb), 112 << mb)
    return q.clamp(max=(1 << (4 + mb)) - 1)


def _dec_mag(c: torch.Tensor, mb: int) -> torch.Tensor:
    sub = c < (1 << mb)
    x = _float((torch.where(sub, c + (1 << mb), c) << (23 - mb)) + (112 << 23))
    return torch.where(sub, x - torch.full_like(x, 2.0**-14), x)


def _dec_m(codes: torch.Tensor) -> torch.Tensor:
    c = codes.to(torch.int64)
    mag = _dec_mag(c & 0x7F, 3)
    return _float(_bits(mag) | ((c & 0x80) << 24))


def _enc_m(m: torch.Tensor, inv: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    bits = _bits(m)
    mag = _float(bits & 0x7FFFFFFF) * inv
    return _enc_mag(mag, r16, 3) | ((bits & 0x80000000) >> 24)


def _block_scales(x: torch.Tensor, maxcode: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (scale, inverse) from the max of |x|'s bits, as the kernel computes them."""
    n = x.numel()
    padded = torch.zeros(num_blocks(n) * BLOCK, dtype=torch.int64)
    padded[:n] = _bits(x) & 0x7FFFFFFF
    maxbits = padded.view(-1, BLOCK).amax(dim=1) if n else padded[:0]
    absmax = _float(maxbits)
    mc = torch.full_like(absmax, maxcode)
    bad = maxbits >= 0x7F800000
    tiny = maxbits < 0x00800000
    zero = torch.zeros_like(absmax)
    scale = torch.where(bad, torch.full_like(absmax, float("nan")),
                        torch.where(tiny, zero, absmax / mc))
    inv = torch.where(bad | tiny, zero, mc / absmax)
    return scale, inv


def _expand(per_block: torch.Tensor, n: int) -> torch.Tensor:
    return per_block.repeat_interleave(BLOCK)[:n]


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    # Correctly rounded, as the kernel's IEEE sqrt (torch's vectorized float sqrt is not always).
    return v.double().sqrt().float()


def encode_q8(m: torch.Tensor, sq: torch.Tensor, r: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 exp_avg and sqrt(exp_avg_sq) -> (m codes, m scales, v codes, v scales).

    ``r``: 32 random bits per element (low half rounds m, high half v).
    """
    n = m.numel()
    sm, im = _block_scales(m, _MAX_M)
    ss, iv = _block_scales(sq, _MAX_S)
    mc = _enc_m(m, _expand(im, n), r & 0xFFFF)
    vc = _enc_mag(sq * _expand(iv, n), r >> 16, 4)
    return mc.to(torch.uint8), sm, vc.to(torch.uint8), ss


def decode_q8(m_codes: torch.Tensor, m_scales: torch.Tensor, v_codes: torch.Tensor,
              v_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit moments -> fp32 (exp_avg, exp_avg_sq), exactly as the kernel reads them."""
    n = m_codes.numel()
    m = _dec_m(m_codes) * _expand(m_scales, n)
    s = _dec_mag(v_codes.to(torch.int64), 4) * _expand(v_scales, n)
    return m, s * s


def encode_bf16(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, stochastically rounded with 16 random bits per element (NaN -> 0xffc0,
    x86's default NaN, as the kernel stores it)."""
    q = ((_bits(x) + r16) & _MASK) >> 16
    q = torch.where(torch.isnan(x), 0xFFC0, q)
    return torch.where(q >= 2**15, q - 2**16, q).to(torch.int16).view(torch.bfloat16)


# --- the public container ----------------------------------------------------------------------


@dataclasses.dataclass
class Moments:
    """Both Adam moments of one flat buffer (or a chunk of one) in one storage format.

    ``exp_avg``/``exp_avg_sq`` are fp32, bf16 or uint8 codes; the scales (fp32, one per block)
    exist only for ``"int8"``. ``offset`` is where this chunk starts in the whole buffer: the
    kernel's rounding counter, so a buffer updated chunk by chunk gives the same bits as in one
    call. Pass a chunk to the kernel with ``ops.fused_adamw_(p, g, **moments.kernel_args(), ...)``.
    """

    moment_dtype: str
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scales: torch.Tensor | None = None
    exp_avg_sq_scales: torch.Tensor | None = None
    offset: int = 0

    @property
    def numel(self) -> int:
        return self.exp_avg.numel()

    @property
    def nbytes(self) -> int:
        ts = (self.exp_avg, self.exp_avg_sq, self.exp_avg_scales, self.exp_avg_sq_scales)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @classmethod
    def zeros(cls, numel: int, moment_dtype: str, *, pin_memory: bool = False) -> Moments:
        """Zero moments (Adam's initial state) for ``numel`` elements; ``moment_bytes`` bytes."""
        _check_dtype(moment_dtype)
        dt = _STORAGE[moment_dtype]
        m = torch.zeros(numel, dtype=dt, pin_memory=pin_memory)
        v = torch.zeros(numel, dtype=dt, pin_memory=pin_memory)
        if moment_dtype != "int8":
            return cls(moment_dtype, m, v)
        nb = num_blocks(numel)
        return cls(moment_dtype, m, v, torch.zeros(nb, pin_memory=pin_memory),
                   torch.zeros(nb, pin_memory=pin_memory))

    @classmethod
    def from_fp32(cls, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, moment_dtype: str
                  ) -> Moments:
        """Convert fp32 moments (e.g. a ``torch.optim.AdamW`` state, flattened) to
        ``moment_dtype``, rounding to nearest. ``"fp32"`` copies."""
        _check_dtype(moment_dtype)
        m, v = _flat_fp32(exp_avg, "exp_avg"), _flat_fp32(exp_avg_sq, "exp_avg_sq")
        if m.numel() != v.numel():
            raise ValueError(f"exp_avg has {m.numel()} elements but exp_avg_sq {v.numel()}")
        if moment_dtype == "fp32":
            return cls("fp32", m.clone(), v.clone())
        if moment_dtype == "bf16":
            return cls("bf16", m.to(torch.bfloat16), v.to(torch.bfloat16))
        # 2**16 elements (whole blocks) at a time: the encoder's int64 temporaries take about
        # 150 bytes per element, so a bucket at once would peak far above the bucket itself
        n, step = m.numel(), 2**16
        mc, vc = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
        sm, sv = torch.empty(num_blocks(n)), torch.empty(num_blocks(n))
        for a in range(0, n, step):
            b, blocks = min(n, a + step), slice(a // BLOCK, num_blocks(min(n, a + step)))
            r = torch.full((b - a,), _NEAREST | (_NEAREST << 16), dtype=torch.int64)
            mc[a:b], sm[blocks], vc[a:b], sv[blocks] = encode_q8(m[a:b], _sqrt(v[a:b]), r)
        return cls("int8", mc, vc, sm, sv)

    def to_fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The moments as fp32 ``(exp_avg, exp_avg_sq)`` (new tensors), exactly as the kernel
        reads them: the form of a ``torch.optim.AdamW`` state."""
        if self.moment_dtype == "int8":
            assert self.exp_avg_scales is not None and self.exp_avg_sq_scales is not None
            n, step = self.numel, 2**16  # whole blocks at a time, as from_fp32
            m, v = torch.empty(n), torch.empty(n)
            for a in range(0, n, step):
                b, blocks = min(n, a + step), slice(a // BLOCK, num_blocks(min(n, a + step)))
                m[a:b], v[a:b] = decode_q8(self.exp_avg[a:b], self.exp_avg_scales[blocks],
                                           self.exp_avg_sq[a:b], self.exp_avg_sq_scales[blocks])
            return m, v
        return self.exp_avg.float().clone(), self.exp_avg_sq.float().clone()

    def copy_(self, other: Moments) -> None:
        """Overwrite these moments with ``other`` (same format and size), in place."""
        if other.moment_dtype != self.moment_dtype or other.numel != self.numel:
            raise ValueError(
                f"cannot copy {other.moment_dtype} moments of {other.numel} elements into "
                f"{self.moment_dtype} moments of {self.numel}; convert with to_fp32/from_fp32"
            )
        for name in ("exp_avg", "exp_avg_sq", "exp_avg_scales", "exp_avg_sq_scales"):
            dst = getattr(self, name)
            if dst is not None:
                dst.copy_(getattr(other, name))

    def chunk(self, start: int, numel: int) -> Moments:
        """Views of elements ``[start, start + numel)``. For ``"int8"`` both ends must be block
        boundaries (multiples of ``BLOCK``), or the end must be the end of the buffer."""
        end = start + numel
        if start < 0 or numel < 0 or end > self.numel:
            raise ValueError(f"chunk [{start}, {end}) is outside moments of {self.numel}")
        if self.moment_dtype != "int8":
            return Moments(self.moment_dtype, self.exp_avg[start:end], self.exp_avg_sq[start:end],
                           offset=self.offset + start)
        if start % BLOCK or (end % BLOCK and end != self.numel):
            raise ValueError(
                f"int8 moments: chunk [{start}, {end}) does not fall on {BLOCK}-element block "
                f"boundaries; cut buffers at multiples of {BLOCK} elements (one scale per block)"
            )
        assert self.exp_avg_scales is not None and self.exp_avg_sq_scales is not None
        b0, b1 = start // BLOCK, num_blocks(end)
        return Moments("int8", self.exp_avg[start:end], self.exp_avg_sq[start:end],
                       self.exp_avg_scales[b0:b1], self.exp_avg_sq_scales[b0:b1],
                       offset=self.offset + start)

    def keep_prefix_(self, numel: int) -> None:
        """Keep elements ``[0, numel)`` only, in new smaller arrays, one array at a time: while
        it runs, memory holds the old arrays plus one new one (a whole new set would double it).
        For ``"int8"``, ``numel`` ends on a block boundary or the buffer's end (as ``chunk``)."""
        view = self.chunk(0, numel)
        for name in ("exp_avg", "exp_avg_sq", "exp_avg_scales", "exp_avg_sq_scales"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(view, name).clone())
                setattr(view, name, None)  # the old storage goes with its last view

    @classmethod
    def named(cls, moment_dtype: str, fields: Mapping[str, Any]) -> Moments:
        """Moments from tensors keyed by torch's names (``exp_avg``, ``exp_avg_sq`` and, for
        int8, ``<name>_scales``), as a checkpoint stores them: :meth:`fields` read back."""
        return cls(moment_dtype, fields["exp_avg"], fields["exp_avg_sq"],
                   fields.get("exp_avg_scales"), fields.get("exp_avg_sq_scales"))

    def fields(self) -> dict[str, torch.Tensor]:
        """The stored tensors by torch's names (the scales only where they exist)."""
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.exp_avg_scales is not None and self.exp_avg_sq_scales is not None:
            out["exp_avg_scales"], out["exp_avg_sq_scales"] = (self.exp_avg_scales,
                                                               self.exp_avg_sq_scales)
        return out

    def kernel_args(self) -> dict:
        """Keyword arguments of ``ops.fused_adamw_`` for these moments."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "exp_avg_scales": self.exp_avg_scales,
                "exp_avg_sq_scales": self.exp_avg_sq_scales, "offset": self.offset}


def _flat_fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise TypeError(f"{name} must be a float32 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    return t.detach().reshape(-1).cpu()
