"""An integer-cache layer as named arrays (what snapshots and files hold), and back."""

from __future__ import annotations

from typing import Any

from .int_codec import IntLayer

__all__ = ["layer_arrays", "restore_layer", "NO_EXP"]

#: Saved in place of an exponent not fixed yet (the layer has held only zeros).
NO_EXP = -(1 << 20)


def layer_arrays(st: IntLayer, windowed: bool) -> dict:
    """The arrays of layer ``st`` by their saved names (views).

    ``k_codes``, ``k_scale``, ``k_offset``, ``v_codes``, ``v_scale``, ``v_offset``,
    ``k_residual``, ``v_window`` (only with a window, ``windowed``) and ``exp`` (int32 ``[k_exp,
    v_exp]``, only when not both 0, so typical data keeps the arrays it always had).
    """
    out = dict(st.kq.arrays())
    out.update(st.vq.arrays())
    out["k_residual"] = st.k_residual
    if windowed:
        out["v_window"] = st.v_window
    if st.exp != (0, 0):
        out["exp"] = st.xp.asarray([NO_EXP if e is None else e for e in st.exp], dtype=st.xp.int32, device=st.device)
    return out


def restore_layer(st: IntLayer, arrays: dict, length: int, group_size: int) -> IntLayer:
    """Fill the fresh layer ``st`` from :func:`layer_arrays` output (copies), checking the token counts."""
    xp: Any = st.xp
    kq = {n: arrays[n] for n in ("k_codes", "k_scale", "k_offset") if n in arrays}
    if kq and int(kq["k_codes"].shape[2]):
        st.kq.append(kq)
    vq = {n: arrays[n] for n in ("v_codes", "v_scale", "v_offset") if n in arrays}
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
    keys = st.kq.length * group_size + int(st.k_residual.shape[2])
    values = st.vq.length + int(st.v_window.shape[2])
    if keys != length or values != length:
        raise ValueError(f"stored arrays hold {keys} keys and {values} values, expected {length} of each")
    st.length = length
    return st
