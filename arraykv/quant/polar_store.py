"""One decode step of a full polar window, written in place: the reference of ``polar_store_token``.

Once a polar cache layer's sinks and recent window are full, each decode step does the same
three things: the oldest window token (a float16 row) is encoded at its position and appended
to the encoded tokens, the new token's key and value are rounded to float16 and join the
window, and nothing is committed if a float16 result overflows (magnitudes above 65504).
:func:`polar_store_token_reference` is that step over preallocated rows: it encodes the row
``leaving`` of the window buffers into index ``at`` of the token buffers' arrays and writes
the new token into the window row ``arriving``; the cache then moves its bookkeeping (window
offsets, lengths) without allocating. ``arraykv.ops.polar_store_token`` runs it as one compiled
call on NumPy, where the dozen small array operations of the step otherwise cost more than
its arithmetic.
"""

from __future__ import annotations

from .. import _compat
from .._types import Array
from .polar import half_dtype
from .polar_encoder import PolarEncoder
from .polar_tokens import polar_encode_tokens_reference

__all__ = ["polar_store_token_reference"]


def polar_store_token_reference(
    k: Array,
    v: Array,
    window_k: Array,
    window_v: Array,
    leaving: int,
    arriving: int,
    enc: PolarEncoder,
    start: int,
    rows: dict,
    at: int,
) -> bool:
    """Encode window row ``leaving`` into token index ``at`` and write ``k``, ``v`` to window row ``arriving``.

    Parameters
    ----------
    k, v : float32 (b, h, 1, d)
        The new token.
    window_k, window_v : float16 (b, h, R, d)
        The window's buffers (written at row ``arriving`` only).
    leaving, arriving : int
        Rows of the window buffers: the token to encode, and where the new token goes
        (``leaving != arriving``).
    enc : PolarEncoder
        The layer's encoding state, as :func:`arraykv.quant.polar_tokens.polar_encode_tokens_reference`
        takes it.
    start : int
        Position of the token being encoded.
    rows : dict of str to array
        The encoded tokens' buffers, (b, h, C, ...) each, with the names and dtypes the encode
        returns (``k_codes``, ``k_norms``, ``v_codes``, ``v_norms``, and ``k_outliers``,
        ``k_qjl``, ``k_qjl_norms`` where the layer has them); written at index ``at`` only.
    at : int
        Token index to write (``0 <= at < C``).

    Returns
    -------
    bool
        True when everything was written. False when a float16 result (the new token's rows,
        a length, an outlier channel) is not finite: then nothing was written here (a kernel
        may have written rows ``at`` and ``arriving``, which the caller does not hold yet).
    """
    xp = _compat.namespace(k)
    f32, half = xp.float32, half_dtype(xp)
    old_k = xp.astype(window_k[:, :, leaving : leaving + 1, :], f32)
    old_v = xp.astype(window_v[:, :, leaving : leaving + 1, :], f32)
    coded = polar_encode_tokens_reference(old_k, old_v, enc, start)
    kh, vh = xp.astype(k, half), xp.astype(v, half)
    floats = [kh, vh] + [a for a in coded.values() if a.dtype == half]
    if not _compat.all_finite(xp, floats):
        return False
    for name, a in coded.items():
        rows[name][:, :, at : at + 1, ...] = a
    window_k[:, :, arriving : arriving + 1, :] = kh
    window_v[:, :, arriving : arriving + 1, :] = vh
    return True
