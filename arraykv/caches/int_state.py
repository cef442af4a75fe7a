"""An integer-cache layer as named arrays (what snapshots and files hold), their checks, and
back; its truncation.

:func:`int_layout` is what a saved layer of ``n`` tokens must hold (checked by
:func:`arraykv.caches.layout.check_layout` before :func:`restore_layer` builds anything): the
shapes of the class docstring of :class:`~arraykv.caches.intq.IntQuantCache` with the packed
widths of the cache's ``bits`` and ``group_size``; keys split as KIVI's schedule splits them
(``⌊n / chunk⌋ · chunk`` quantized, the rest exact, ``chunk`` the window or one group) and
values likewise (the latest ``min(n, R)`` exact); scales, offsets and exact tokens finite and
bounded; exponents in ``[MIN_EXPONENT, MAX_EXPONENT]``; every group's largest reconstruction
``max(|offset|, |offset + scale · (2**bits − 1)|) · 2**exp`` and every exact token within the
range of the layer's dtype (a float16 layer could otherwise return infinity); rollback copies
of whole key chunks, no more than were quantized or than ``rollback_tokens`` asks;
``fixed_end`` in ``[0, n]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from .._types import Array, DType, Namespace
from ..quant.bitpack import packed_nbytes
from ..quant.intq import MIN_EXPONENT
from .int_codec import IntLayer
from .layout import Layout, Spec, bounded, fixed_end_spec

__all__ = [
    "layer_arrays",
    "restore_layer",
    "int_layout",
    "NO_EXP",
    "MAX_EXPONENT",
    "key_copies",
    "truncate_floor",
    "truncate_plan",
]

#: Saved in place of an exponent not fixed yet (the layer has held only zeros).
NO_EXP = -(1 << 20)
#: Largest exponent a saved layer's units may have: data beyond ``2**64`` would overflow the
#: float32 attention over it anyway (legitimate exponents lie far below).
MAX_EXPONENT = 64


class _IntOptions(Protocol):
    """What these functions read of an :class:`~arraykv.caches.intq.IntQuantCache`."""

    num_kv_heads: int
    head_dim: int
    group_size: int
    bits: int
    residual_window: int
    rollback_tokens: int


def layer_arrays(st: IntLayer, windowed: bool) -> dict[str, Array]:
    """The arrays of layer ``st`` by their saved names (views).

    ``k_codes``, ``k_scale``, ``k_offset``, ``v_codes``, ``v_scale``, ``v_offset``,
    ``k_residual``, ``v_window`` (only with a window, ``windowed``) and ``exp`` (int32 ``[k_exp,
    v_exp]``, only when not both 0, so typical data keeps the arrays it always had), the
    rollback copies ``k_rollback``, ``v_rollback`` and ``fixed_end`` (int64, shape (1,)).
    """
    out = dict(st.kq.arrays())
    out.update(st.vq.arrays())
    out["k_residual"] = st.k_residual
    if windowed:
        out["v_window"] = st.v_window
    if st.exp != (0, 0):
        out["exp"] = st.xp.asarray([NO_EXP if e is None else e for e in st.exp], dtype=st.xp.int32, device=st.device)
    out["k_rollback"], out["v_rollback"] = st.k_rollback, st.v_rollback
    out["fixed_end"] = st.xp.asarray([st.fixed_end], dtype=st.xp.int64, device=st.device)
    return out


def int_layout(
    cache: _IntOptions,
    xp: Namespace,
    batch: int,
    length: int,
    layer_dtype: DType,
    param_dtype: DType,
    exact_dtype: DType,
) -> Layout:
    """The :class:`~arraykv.caches.layout.Layout` of a saved layer of ``cache`` (see the module docstring).

    ``layer_dtype`` is the dtype the layer returns, ``param_dtype`` that of the scales and
    offsets, ``exact_dtype`` that of the exact tokens and the rollback copies (float16 with a
    window, else the layer's dtype).
    """
    b, h, d = batch, cache.num_kv_heads, cache.head_dim
    g, bits, r = cache.group_size, cache.bits, cache.residual_window
    chunk = r or g
    arrays = {
        "k_codes": Spec(xp.uint8, (b, h, "groups", d, packed_nbytes(g, bits)), required=False),
        "k_scale": bounded(param_dtype, (b, h, "groups", d), required=False),
        "k_offset": bounded(param_dtype, (b, h, "groups", d), required=False),
        "v_codes": Spec(xp.uint8, (b, h, "values", packed_nbytes(d, bits)), required=False),
        "v_scale": bounded(param_dtype, (b, h, "values", -(-d // g)), required=False),
        "v_offset": bounded(param_dtype, (b, h, "values", -(-d // g)), required=False),
        "k_residual": bounded(exact_dtype, (b, h, "residual", d)),
    }
    if r:
        arrays["v_window"] = bounded(exact_dtype, (b, h, "window", d))
    arrays.update(
        exp=Spec(xp.int32, (2,), required=False),
        k_rollback=bounded(exact_dtype, (b, h, "k_copies", d), required=False),
        v_rollback=bounded(exact_dtype, (b, h, "v_copies", d), required=False),
        fixed_end=fixed_end_spec(xp),
    )

    def counts(sizes: dict[str, int], held: frozenset[str]) -> str | None:
        keys, values = sizes.get("groups", 0) * g, sizes.get("values", 0)
        exact_keys, window = sizes["residual"], sizes.get("window", 0)
        if keys != length // chunk * chunk or keys + exact_keys != length:
            return (
                f"stored arrays hold {keys} quantized and {exact_keys} exact keys; a layer of {length} tokens "
                f"holds {length // chunk * chunk} and {length % chunk}"
            )
        if window != min(length, r) or values + window != length:
            return (
                f"stored arrays hold {values} quantized and {window} exact values; a layer of {length} tokens "
                f"holds {length - min(length, r)} and {min(length, r)}"
            )
        return None

    def copies(sizes: dict[str, int], held: frozenset[str]) -> str | None:
        keys, values = sizes.get("groups", 0) * g, sizes.get("values", 0)
        kc, vc = sizes.get("k_copies", 0), sizes.get("v_copies", 0)
        if kc % chunk or kc > min(key_copies(cache), keys):
            return (
                f"stored 'k_rollback' holds {kc} keys; at most {min(key_copies(cache), keys)} in whole chunks of "
                f"{chunk}"
            )
        if vc > (min(cache.rollback_tokens, values) if r else 0):
            return f"stored 'v_rollback' holds {vc} values; at most {min(cache.rollback_tokens, values) if r else 0}"
        return None

    def exponents(xp: Namespace, sizes: dict[str, int], held: dict[str, Array]) -> str | None:
        if "exp" not in held:
            return None
        exps = [int(e) for e in held["exp"]]
        if any(e != NO_EXP and not MIN_EXPONENT <= e <= MAX_EXPONENT for e in exps):
            return f"stored 'exp' must hold exponents in [{MIN_EXPONENT}, {MAX_EXPONENT}], received {exps}"
        return None

    def reconstruction(xp: Namespace, sizes: dict[str, int], held: dict[str, Array]) -> str | None:
        # the largest |scale · code + offset| of every group (codes 0 .. 2**bits - 1) and the
        # exact tokens, in the layer's units: what dequantize returns must fit the layer's dtype
        exps = [0 if "exp" not in held else int(e) for e in held.get("exp", (0, 0))]
        top, limit = (1 << bits) - 1, float(xp.finfo(layer_dtype).max)
        for side, exp in zip(("k", "v"), exps):
            parts = []
            if f"{side}_scale" in held:
                o = xp.astype(held[f"{side}_offset"], xp.float32)
                top_of = xp.abs(o + xp.astype(held[f"{side}_scale"], xp.float32) * top)
                parts.append((f"'{side}_scale' and '{side}_offset'", xp.maximum(xp.abs(o), top_of)))
            exact_name = "k_residual" if side == "k" else "v_window"
            if held.get(exact_name) is not None:
                parts.append((f"'{exact_name}'", xp.abs(xp.astype(held[exact_name], xp.float32))))
            unit = 2.0 ** (0 if exp == NO_EXP else exp)
            for names, a in parts:
                if math.prod(int(n) for n in a.shape) and float(xp.max(a)) * unit > limit:
                    return f"stored {names} reconstruct to magnitudes beyond {limit:g}, the range of the layer's dtype"
        return None

    return Layout(
        arrays=arrays,
        groups=(("k_codes", "k_scale", "k_offset"), ("v_codes", "v_scale", "v_offset"), ("k_rollback", "v_rollback")),
        sizes={"length": length},
        rules=(counts, copies),
        value_rules=(exponents, reconstruction),
    )


def restore_layer(st: IntLayer, arrays: dict[str, Array], length: int, group_size: int) -> IntLayer:
    """Fill the fresh layer ``st`` from :func:`layer_arrays` output (copies) that passed :func:`int_layout`."""
    xp: Namespace = st.xp
    kq: dict[str, Array] = {n: arrays[n] for n in ("k_codes", "k_scale", "k_offset") if n in arrays}
    if kq and int(kq["k_codes"].shape[2]):
        st.kq.append(kq)
    vq: dict[str, Array] = {n: arrays[n] for n in ("v_codes", "v_scale", "v_offset") if n in arrays}
    if vq and int(vq["v_codes"].shape[2]):
        st.vq.append(vq)
    st.k_residual = xp.asarray(arrays["k_residual"], copy=True)
    if "v_window" in arrays:
        st.v_window = xp.asarray(arrays["v_window"], copy=True)
    if "exp" in arrays:
        exps = (int(arrays["exp"][0]), int(arrays["exp"][1]))
        st.exp = tuple(None if e == NO_EXP else e for e in exps)
    else:
        st.exp = (0, 0)
    for name in ("k_rollback", "v_rollback"):  # files written before rollback copies existed have none
        if name in arrays:
            setattr(st, name, xp.asarray(arrays[name], copy=True))
    # without the record, the units may have been fixed by the latest store: no cut is known safe
    st.fixed_end = int(arrays["fixed_end"][0]) if "fixed_end" in arrays else length
    keys = st.kq.length * group_size + int(st.k_residual.shape[2])
    values = st.vq.length + int(st.v_window.shape[2])
    if keys != length or values != length:
        raise ValueError(f"stored arrays hold {keys} keys and {values} values, expected {length} of each")
    st.length = length
    return st


def key_copies(cache: _IntOptions) -> int:
    """Exact keys an int layer keeps for rollback: whole chunks covering ``rollback_tokens``.

    Keys are quantized ``chunk`` at a time (``residual_window``, else ``group_size``), so
    taking back ``D`` tokens can reopen ``ceil(D / chunk)`` chunks.
    """
    chunk = cache.residual_window or cache.group_size
    return -(-cache.rollback_tokens // chunk) * chunk


def _cut(cache: _IntOptions, st: IntLayer, length: int) -> tuple[int, int, int, int, bool]:
    """``(kt', k_lo, vt', v_lo, ok)`` of a truncation to ``length``: keys quantized afterwards
    and the first key held exactly (copies, then residual); the same for values; reachable."""
    g, r = cache.group_size, cache.residual_window
    chunk = r or g
    kt, vt = st.kq.length * g, st.vq.length
    kt2 = length // chunk * chunk
    k_lo = kt - int(st.k_rollback.shape[2])
    vt2 = length - min(length, r)
    v_lo = vt - int(st.v_rollback.shape[2])
    ok = (kt2 == length or kt2 >= k_lo) and (vt2 == length or vt2 >= v_lo or not r)
    return kt2, k_lo, vt2, v_lo, ok


def truncate_floor(cache: _IntOptions, st: IntLayer) -> int:
    """Smallest length above 0 that layer ``st`` of ``cache`` can be truncated to exactly.

    Notes
    -----
    A layer of ``n`` tokens has quantized its first ``kt = ⌊n / chunk⌋ · chunk`` keys and its
    first ``vt = n − min(n, R)`` values (every value when ``R = 0``); a direct build of ``L``
    tokens the first ``kt' = ⌊L / chunk⌋ · chunk`` keys and ``vt'`` values by the same rules,
    with the same codes (a group's codes depend on its tokens only, in units fixed by the
    layer's first non-zero store). Its exact keys ``kt' .. L − 1`` must be among the key copies
    and the residual, its exact values among the value copies and the window; and ``L`` must
    not be inside the store that fixed the units (``fixed_end``).
    """
    low = max(1, st.fixed_end)
    for length in range(st.length - 1, low - 1, -1):
        if not _cut(cache, st, length)[-1]:
            return length + 1
    return low


def truncate_plan(cache: _IntOptions, st: IntLayer, length: int) -> Callable[[], None]:
    """Everything of a truncation of ``st`` to a reachable ``length``, computed; returns the commit."""
    xp = st.xp
    g = cache.group_size
    kt2, k_lo, vt2, v_lo, _ = _cut(cache, st, length)
    kr, vr = st.k_rollback, st.v_rollback
    ek = xp.concat([kr, st.k_residual], axis=2) if int(kr.shape[2]) else st.k_residual
    residual = ek[:, :, kt2 - k_lo : length - k_lo, :] if length > kt2 else st.k_residual[:, :, :0, :]
    k_keep = kr[:, :, : max(0, int(kr.shape[2]) - (st.kq.length * g - kt2)), :]
    window, v_keep = st.v_window, vr
    if cache.residual_window:
        ev = xp.concat([vr, st.v_window], axis=2) if int(vr.shape[2]) else st.v_window
        window = ev[:, :, vt2 - v_lo : length - v_lo, :] if length > vt2 else st.v_window[:, :, :0, :]
        v_keep = vr[:, :, : max(0, int(vr.shape[2]) - (st.vq.length - vt2)), :]
    kplan = st.kq.truncate_plan(kt2 // g)
    vplan = st.vq.truncate_plan(vt2)

    def commit() -> None:
        st.kq.commit_truncate(kplan)
        st.vq.commit_truncate(vplan)
        st.k_residual, st.v_window, st.k_rollback, st.v_rollback = residual, window, k_keep, v_keep

    return commit
