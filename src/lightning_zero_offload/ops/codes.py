"""The storage codes of compact moments, in torch: the kernel's rounding bits, bf16 with
stochastic rounding, and the block-wise 8-bit codes (``ops.moments`` says what they are).

Every function here computes what ``src/kernels/compact.h`` computes, operation for operation,
in exact int64 arithmetic where the kernel uses 32-bit integers.
"""

from __future__ import annotations

import torch

BLOCK = 256
_MASK = 0xFFFFFFFF
_MAX_M = 1.875  # largest E4M3 magnitude
_MAX_S = 1.9375  # largest E4M4 value
# A block holding a non-finite value is "marked": its scale's sign bit is set (scales are
# otherwise +0 or positive, so a stored scale of any earlier block reads as before), it is scaled
# over its finite values to a smaller top code, and the codes above that (and exp_avg's -0) keep
# each non-finite value in its own element.
_MAX_M_X, _MAX_S_X = 1.75, 1.8125  # a marked block's largest finite code: 0x7e, 0xfd
_NAN_M, _INF_M = 0x80, 0x7F  # exp_avg: NaN (-0's code); +-inf (the top magnitude, signed)
_NAN_S, _INF_S = 0xFE, 0xFF  # sqrt(exp_avg_sq): NaN, +inf
SIGNED, SQRT = "signed", "sqrt"  # a first moment's code, a second moment's (of its sqrt)


def num_blocks(numel: int) -> int:
    """Number of 8-bit blocks (and scales per moment) for ``numel`` elements."""
    return -(-numel // BLOCK)


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


def word_key(key: int, word: int) -> int:
    """The key of random word ``word`` of an element: state array j rounds with the low
    (j even) or high (j odd) 16 bits of word j // 2. Word 0 is the step's key itself (the
    kernel's, which holds at most two arrays); word w > 0 a key of its own, hashed from both."""
    return key if word == 0 else _hash32_int(key ^ _hash32_int(word ^ 0x9E3779B9))


def half(word: torch.Tensor, array: int) -> torch.Tensor:
    """State array ``array``'s 16 rounding bits of its word (:func:`word_key`)."""
    return (word >> 16) if array % 2 else (word & 0xFFFF)


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


def _block_scales(x: torch.Tensor, maxcode: float, maxcode_marked: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block (scale, inverse, marked) from the max of the finite |x|'s bits, as the kernel
    computes them; a marked block's scale has its sign bit set (-0.0 for a zero one)."""
    n = x.numel()
    bits = _bits(x) & 0x7FFFFFFF
    bad = torch.zeros(num_blocks(n) * BLOCK, dtype=torch.bool)
    bad[:n] = bits >= 0x7F800000
    padded = torch.zeros(num_blocks(n) * BLOCK, dtype=torch.int64)
    padded[:n] = torch.where(bad[:n], 0, bits)
    maxbits = padded.view(-1, BLOCK).amax(dim=1) if n else padded[:0]
    marked = bad.view(-1, BLOCK).any(dim=1) if n else bad[:0]
    absmax = _float(maxbits)
    mc = torch.where(marked, maxcode_marked, maxcode).float()
    tiny = maxbits < 0x00800000
    zero = torch.zeros_like(absmax)
    scale = torch.where(tiny, zero, absmax / mc)
    inv = torch.where(tiny, zero, mc / absmax)
    return torch.where(marked, -scale, scale), inv, marked


def _expand(per_block: torch.Tensor, n: int) -> torch.Tensor:
    return per_block.repeat_interleave(BLOCK)[:n]


def _sqrt(v: torch.Tensor) -> torch.Tensor:
    # Correctly rounded, as the kernel's IEEE sqrt (torch's vectorized float sqrt is not always).
    return v.double().sqrt().float()


def encode_bf16(x: torch.Tensor, r16: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, stochastically rounded with 16 random bits per element (NaN -> 0xffc0,
    x86's default NaN, as the kernel stores it)."""
    q = ((_bits(x) + r16) & _MASK) >> 16
    q = torch.where(torch.isnan(x), 0xFFC0, q)
    return torch.where(q >= 2**15, q - 2**16, q).to(torch.int16).view(torch.bfloat16)



def encode(x: torch.Tensor, codec: str, r16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (uint8 codes, per-block scales) in ``codec``, rounding bits ``r16``. A block with
    a non-finite value is marked (see ``_MAX_M_X``): its finite values are coded as usual below
    its smaller top code, its NaN and infinities by their own codes."""
    n = x.numel()
    if codec == SIGNED:
        scale, inv, marked = _block_scales(x, _MAX_M, _MAX_M_X)
        codes = _enc_m(x, _expand(inv, n), r16)
        if marked.any():
            sign = codes & 0x80
            mag = (codes & 0x7F).clamp(max=_INF_M - 1)
            finite = torch.where(mag == 0, 0, sign) | mag  # -0 is NaN's code here: +0
            other = torch.where(torch.isnan(x), _NAN_M, _INF_M | ((_bits(x) >> 24) & 0x80))
            codes = torch.where(_expand(marked, n),
                                torch.where(torch.isfinite(x), finite, other), codes)
        return codes.to(torch.uint8), scale
    sq = _sqrt(x)
    scale, inv, marked = _block_scales(sq, _MAX_S, _MAX_S_X)
    codes = _enc_mag(sq * _expand(inv, n), r16, 4)
    if marked.any():
        coded = torch.where(torch.isnan(sq), _NAN_S,
                            torch.where(torch.isinf(sq), _INF_S, codes.clamp(max=_NAN_S - 1)))
        codes = torch.where(_expand(marked, n), coded, codes)
    return codes.to(torch.uint8), scale


def decode(codes: torch.Tensor, scales: torch.Tensor, codec: str) -> torch.Tensor:
    n = codes.numel()
    marked = torch.signbit(scales)
    sc = _expand(scales.abs(), n)
    c = codes.to(torch.int64)
    if codec == SIGNED:
        out = _dec_m(codes) * sc
        if marked.any():
            mk = _expand(marked, n)
            inf = torch.where(c >= 0x80, -torch.inf, torch.inf)
            out = torch.where(mk & (c == _NAN_M), torch.nan, out)
            out = torch.where(mk & ((c & 0x7F) == _INF_M), inf, out)
        return out
    s = _dec_mag(c, 4) * sc
    out = s * s
    if marked.any():
        mk = _expand(marked, n)
        out = torch.where(mk & (c == _NAN_S), torch.nan, out)
        out = torch.where(mk & (c == _INF_S), torch.inf, out)
    return out
