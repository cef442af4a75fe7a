"""Input checks shared by the public entry points.

Every check raises ``ValueError`` or ``TypeError`` that names the parameter, says what is
allowed and what was received. Checks run before any state changes, so a rejected call leaves
a cache exactly as it was.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from . import _compat
from ._types import Array, Device, DType, Namespace

__all__ = [
    "check_auto_bool",
    "check_float_array",
    "check_bool",
    "check_int",
    "check_real",
    "check_softmax_scale",
    "check_kv",
    "check_query",
    "check_finite",
    "dtype_name",
    "is_floating",
]


def dtype_name(dtype: DType) -> str:
    """A short printable name of ``dtype`` (``'float32'``, also for ``torch.float32``)."""
    s = str(dtype)
    for prefix in ("array_api_strict.", "dtype(", "<class 'numpy.", "torch."):
        s = s.replace(prefix, "")
    return s.strip("')>")


def is_floating(xp: Namespace, dtype: DType) -> bool:
    """True for real floating dtypes (float16/float32/float64) of namespace ``xp``."""
    return dtype in _compat.float_dtypes(xp)


def _is_bool(value: Any) -> bool:
    """True for Python and NumPy booleans (``np.bool_`` is neither ``bool`` nor a number)."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` as a Python ``bool`` after checking it is one (NumPy booleans included).

    A NumPy boolean comes back as ``bool``, so it is stored and saved like a Python one.
    """
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, received {type(value).__name__} {value!r}")
    return bool(value)


def check_auto_bool(name: str, value: Any) -> bool | str:
    """Return ``"auto"`` or ``value`` as a Python ``bool`` (NumPy booleans included).

    Raises ``ValueError`` for anything else (``1``, ``1.0`` and ``"yes"`` included).
    """
    if isinstance(value, str) and value == "auto":
        return value
    if not _is_bool(value):
        raise ValueError(f"{name} must be 'auto', True or False, received {value!r}")
    return bool(value)


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """Return ``value`` as ``int`` after checking it is an integer in ``[low, high]``.

    NumPy integers are accepted and come back as Python ``int``; booleans are refused.
    """
    if _is_bool(value):
        raise TypeError(f"{name} must be an integer, received bool {value!r}")
    try:
        iv = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, received {type(value).__name__} {value!r}") from None
    if low is not None and iv < low:
        raise ValueError(f"{name} must be >= {low}, received {iv}")
    if high is not None and iv > high:
        raise ValueError(f"{name} must be <= {high}, received {iv}")
    return iv


def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a finite Python ``float`` after checking it lies within the bounds.

    Parameters
    ----------
    name : str
        The parameter's name, for the message.
    value : int, float or NumPy real scalar
        Booleans and strings are refused (``TypeError``).
    low, high : float, optional
        Bounds; inclusive unless ``low_open`` / ``high_open``.

    Returns
    -------
    float
        NumPy scalars come back as Python floats, so they save as plain JSON and never promote
        float32 arrays to float64.

    Raises
    ------
    TypeError
        ``value`` is not a real number.
    ValueError
        NaN, infinite, or outside the bounds.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, received {type(value).__name__} {value!r}")
    fv = float(value)
    if not math.isfinite(fv):
        raise ValueError(f"{name} must be finite, received {value!r}")
    if low is not None and (fv <= low if low_open else fv < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, received {value!r}")
    if high is not None and (fv >= high if high_open else fv > high):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, received {value!r}")
    return fv


#: The largest softmax scale accepted. Models use ``1 / sqrt(head_dim)`` (or a similar constant
#: at most 1); a scale near float32's range turns every logit into infinity and the softmax into
#: NaN, so a value that large is refused instead.
MAX_SOFTMAX_SCALE = 1e4


def check_softmax_scale(value: Any, name: str = "softmax_scale") -> float:
    """Return the softmax scale as a positive finite Python ``float`` of at most :data:`MAX_SOFTMAX_SCALE`.

    Every public attention entry point calls this, so NaN, infinity, zero, negative and absurdly
    large scales, booleans and strings are refused the same way everywhere (``ValueError`` for a
    bad number, ``TypeError`` for something that is not a real number).
    """
    if type(value) is float and 0.0 < value <= MAX_SOFTMAX_SCALE:  # the common case, once per decode step
        return value
    return check_real(name, value, low=0.0, low_open=True, high=MAX_SOFTMAX_SCALE)


def _check_array(name: str, x: Array) -> None:
    try:
        _compat.namespace(x)
    except TypeError:
        raise TypeError(f"{name} must be an array, received {type(x).__name__}") from None
    if getattr(x, "requires_grad", False) is True:  # a PyTorch tensor in an autograd graph
        raise TypeError(
            f"{name} requires grad; a cache stores values and is not differentiable: pass "
            f"{name}.detach() or call it under torch.no_grad()"
        )
    layout = getattr(x, "layout", None)
    if layout is not None and "strided" not in str(layout):  # a sparse PyTorch tensor
        raise TypeError(f"{name} must be a dense (strided) tensor, received layout {layout}; pass {name}.to_dense()")
    if getattr(getattr(x, "device", None), "type", None) == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape without data); pass a tensor that holds values")


def array_namespace(**arrays: Array) -> Namespace:
    """The one namespace of the named arrays; ``TypeError`` naming the first that is not an array."""
    for name, x in arrays.items():
        _check_array(name, x)
    return _compat.namespace(*arrays.values())


def check_kv(
    k: Array, v: Array, *, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None
) -> tuple[Namespace, tuple[int, int, int, int]]:
    """Check a ``(batch, kv_heads, new_tokens, head_dim)`` key/value pair.

    Returns
    -------
    xp : namespace
    shape : tuple of int
        ``(batch, kv_heads, new_tokens, head_dim)`` of ``k``.
    """
    _check_array("k", k)
    _check_array("v", v)
    xp = _compat.namespace(k, v)
    for name, x in (("k", k), ("v", v)):
        check_float_array(xp, name, x, "(batch, kv_heads, new_tokens, head_dim)")
    if k.dtype != v.dtype:
        raise TypeError(f"k and v must share one dtype, received {dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
    vd = head_dim if v_head_dim is None else v_head_dim
    if tuple(k.shape[:3]) != tuple(v.shape[:3]) or (v_head_dim is None and tuple(k.shape) != tuple(v.shape)):
        raise ValueError(f"k and v shapes must match, received {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, t, d = (int(s) for s in k.shape)
    if h != num_kv_heads:
        raise ValueError(f"k must have {num_kv_heads} kv heads (axis 1), received {h}")
    if d != head_dim:
        raise ValueError(f"k must have head_dim {head_dim} (axis 3), received {d}")
    if int(v.shape[3]) != vd:
        raise ValueError(f"v must have head_dim {vd} (axis 3), received {int(v.shape[3])}")
    if b < 1:
        raise ValueError(f"k must have batch >= 1, received shape {tuple(k.shape)}")
    if t < 1:
        raise ValueError(f"k must hold at least one new token (axis 2), received shape {tuple(k.shape)}")
    if _compat.device(k) != _compat.device(v):
        raise ValueError(f"k and v must be on one device, received {_compat.device(k)} and {_compat.device(v)}")
    return xp, (b, h, t, d)


def check_float_array(xp: Namespace, name: str, x: Array, axes: str) -> None:
    """Check that ``x`` has one dimension per name in ``axes`` (e.g. ``"(heads, n, head_dim)"``) and a floating dtype.

    Raises
    ------
    ValueError
        The number of dimensions differs (the message names ``name`` and ``axes``).
    TypeError
        The dtype is not floating.
    """
    ndim = axes.count(",") + 1
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {axes}, received shape {tuple(x.shape)}")
    if not is_floating(xp, x.dtype):
        allowed = ", ".join(dtype_name(dt) for dt in _compat.float_dtypes(xp))
        raise TypeError(f"{name} must have a floating dtype ({allowed}), received {dtype_name(x.dtype)}")


def check_query(
    q: Array, xp: Namespace, kv_shape: tuple[int, ...], *, q_head_dim: int | None = None, device: Device = None
) -> int:
    """Check ``q`` against a checked K shape (and ``k``'s ``device`` when given); return
    ``n_kv_groups`` (query heads per KV head)."""
    _check_array("q", q)
    if _compat.namespace(q) is not xp:
        raise TypeError(
            f"q must come from the same array library as k and v, received {type(q).__module__}.{type(q).__name__}"
        )
    if device is not None and _compat.device(q) != device:
        raise ValueError(f"q must be on the device of k and v ({device}), received {_compat.device(q)}")
    b, h, t, d = kv_shape
    check_float_array(xp, "q", q, "(batch, q_heads, new_tokens, head_dim)")
    qb, qh, qt, qd = (int(s) for s in q.shape)
    if qb != b:
        raise ValueError(f"q must have batch {b} like k, received {qb}")
    if qt != t:
        raise ValueError(f"q must have {t} new tokens like k (axis 2), received {qt}")
    if qd != (d if q_head_dim is None else q_head_dim):
        raise ValueError(f"q must have head_dim {d} like k (axis 3), received {qd}")
    if qh < h or qh % h != 0:
        raise ValueError(f"q heads must be a positive multiple of the {h} kv heads, received {qh}")
    return qh // h


def check_finite(xp: Namespace, **arrays: Array) -> None:
    """Raise ``ValueError`` if any named array holds NaN or infinity."""
    if _compat.all_finite(xp, list(arrays.values())):
        return
    for name, x in arrays.items():
        if not _compat.all_finite(xp, [x]):
            raise ValueError(f"{name} holds non-finite values (NaN or Inf); the cache accepts finite values only")
