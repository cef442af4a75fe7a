"""Checking a layer's arrays before a cache is built from them: :class:`Layout`, :func:`check_layout`.

A layer comes back from a file (:func:`arraykv.load`) or from a caller
(:meth:`~arraykv.caches.LayeredCache.restore`) as named arrays and a header (``length``,
``batch``, ``dtype``). Neither is trusted: the SHA-256 trailer of a file is a checksum that
anyone who edits the file can recompute. The kernels that read a layer later index its arrays
by the sizes they find in them (packed code widths, token counts, channel indices, codes into
a codebook), so every array is checked here, completely, before anything is built from it;
a layer that fails raises ``ValueError`` and nothing changes.

A cache describes the arrays a layer of its own may hold, for a header and the cache's
options, as a :class:`Layout` (its hook ``_layer_layout``):

``arrays``
    By name, a :class:`Spec`: the dtype, the shape, whether the array must be there, and the
    range of its values. A shape entry is a number, the *name* of a size (``"codes"``,
    ``"n_out"``), which the first array that has it binds and every other one must match, or a
    function of the sizes bound so far (a packed width that depends on a codebook's size read
    from another array).
``groups``
    Names held all together or not at all (the arrays of the encoded tokens, a calibration).
``rules``
    Functions of the sizes found and the names held that return a message when the layer is
    not one the cache can reach: token counts that must add up to ``length``, rollback copies
    at most ``rollback_tokens`` and never more than the tokens encoded, a window of the size
    the cache keeps.
``value_rules``
    Functions of the arrays that return a message when their values break a rule that
    involves several arrays (codes below the size of the codebook they index).

:func:`check_layout` checks, in this order: no array unknown or missing, the groups, every
dtype and shape (binding the sizes), the rules on sizes, then the values: floating arrays
finite and inside their range, integer arrays (indices, counts, exponents) inside theirs,
ascending where the spec asks, and the value rules. Values are read only once the shapes
agree, so no check reads past an array.

Floating arrays must be finite whatever the cache's ``check_finite`` says: no attention over
a layer holding NaN or infinity is finite. The floating parameters of a codec held in float32
(means, bases, centroids, scales, coefficients) are bounded by :data:`MAX_MAGNITUDE` besides:
the float16 parts of every compressed cache hold at most 65504, and a product of two stored
numbers summed over a head stays far inside float32 only when neither is absurdly large.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import _compat
from .._types import Array, DType, Namespace

#: A bound of a :class:`Spec`: a number, the name of a size, a function of the sizes, or None.
Bound = float | str | Callable[[dict[str, int]], float] | None

__all__ = ["Spec", "Layout", "check_layout", "join", "MAX_MAGNITUDE", "bounded", "fixed_end_spec"]

#: Largest magnitude a float32 (or float64) parameter of a codec may hold: ``2**32``. The
#: float16 parts are bounded by their dtype (65504); a product of two parameters at this bound,
#: summed over 4096 channels and 4096 ranks, is ``2**88``, far below float32's ``2**128``.
MAX_MAGNITUDE = 2.0**32


@dataclass(frozen=True)
class Spec:
    """What one saved array of a layer must be.

    Attributes
    ----------
    dtype : dtype, tuple of dtypes, or callable
        The dtype (one of the tuple), or a function of the sizes bound so far returning it.
    shape : tuple
        Per axis: an int, the name of a size (bound by the first array that has it, checked
        in every other), or a function of the sizes bound so far returning an int.
    required : bool, default True
        Whether the layer always holds the array.
    low, high : number, str, callable or None
        Inclusive bounds of the values (a number, the name of a size, or a function of the
        sizes); None: no bound.
    ascending : bool, default False
        Values strictly ascending along the last axis (index lists).
    """

    dtype: DType | tuple[DType, ...] | Callable[[dict[str, int]], DType]
    shape: tuple
    required: bool = True
    low: Bound = None
    high: Bound = None
    ascending: bool = False


@dataclass(frozen=True)
class Layout:
    """The arrays a layer may hold, and the rules between them (see the module docstring).

    Attributes
    ----------
    arrays : dict of str to Spec
        Every name the layer may hold; checked in this order (a shape function may use the
        sizes that arrays before it bound).
    sizes : dict of str to int
        Sizes known beforehand (``"b"``, ``"h"``, ``"d"``, ``"length"``, ...).
    groups : tuple of tuple of str
        Names held all together or not at all.
    rules : tuple of callable
        ``rule(sizes, held) -> str or None``: ``sizes`` the sizes bound (a size no held array
        has is absent), ``held`` the frozenset of names held; a message when the layer breaks it.
    value_rules : tuple of callable
        ``rule(xp, sizes, arrays) -> str or None``, run last, on arrays whose shapes, dtypes and
        ranges passed.
    """

    arrays: dict
    sizes: dict = field(default_factory=dict)
    groups: tuple = ()
    rules: tuple = ()
    value_rules: tuple = ()


def join(*layouts: Layout, sizes: dict | None = None, rules: tuple = ()) -> Layout:
    """One layout of several parts (their arrays in order, groups and rules), plus ``sizes`` and ``rules``."""
    arrays: dict = {}
    for part in layouts:
        arrays.update(part.arrays)
    known = dict(sizes or {})
    for part in layouts:
        known.update(part.sizes)
    return Layout(
        arrays=arrays,
        sizes=known,
        groups=sum((p.groups for p in layouts), ()),
        rules=sum((p.rules for p in layouts), ()) + tuple(rules),
        value_rules=sum((p.value_rules for p in layouts), ()),
    )


def bounded(dtype: DType, shape: tuple, *, required: bool = True) -> Spec:
    """A :class:`Spec` of codec parameters in ``dtype``: finite, ``|x| <= MAX_MAGNITUDE``."""
    return Spec(dtype, shape, required=required, low=-MAX_MAGNITUDE, high=MAX_MAGNITUDE)


def fixed_end_spec(xp: Namespace) -> Spec:
    """The saved record of a layer's calibrating call: int64 of shape (1,), in ``[0, length]``."""
    return Spec(xp.int64, (1,), required=False, low=0, high="length")


def check_layout(xp: Namespace, arrays: dict, layout: Layout) -> dict:
    """Check a layer's ``arrays`` (by name, namespace ``xp``) against ``layout``.

    Returns
    -------
    dict
        The sizes: those of ``layout.sizes`` and those the arrays bound.

    Raises
    ------
    ValueError
        Naming the first array or rule the layer breaks.
    """
    unknown = sorted(set(arrays) - set(layout.arrays))
    if unknown:
        raise ValueError(f"unexpected arrays {unknown}; this layer may hold {sorted(layout.arrays)}")
    missing = [n for n, s in layout.arrays.items() if s.required and n not in arrays]
    if missing:
        raise ValueError(f"stored arrays {missing} are missing")
    for group in layout.groups:
        held = [n for n in group if n in arrays]
        if held and len(held) != len(group):
            raise ValueError(f"stored arrays {list(group)} come together; received only {held}")
    sizes = dict(layout.sizes)
    for name, spec in layout.arrays.items():
        if name in arrays:
            _check_shape(name, arrays[name], spec, sizes)
    present = frozenset(arrays)
    for rule in layout.rules:
        _raise(rule(sizes, present))
    floats = _compat.float_dtypes(xp)
    for name, spec in layout.arrays.items():
        if name in arrays:
            _check_values(xp, name, arrays[name], spec, sizes, floats)
    for rule in layout.value_rules:
        _raise(rule(xp, sizes, arrays))
    return sizes


def _raise(message: str | None) -> None:
    if message:
        raise ValueError(message)


def _resolve(name: str, value: Any, sizes: dict[str, int]) -> Any:
    """A number, a size name or a function of the sizes, as a value."""
    try:
        if callable(value) and not isinstance(value, type):
            return value(sizes)
        if isinstance(value, str):
            return sizes[value]
    except KeyError as exc:
        raise ValueError(f"stored array {name!r} needs size {exc} of another array, which the layer lacks") from None
    return value


def _check_shape(name: str, a: Array, spec: Spec, sizes: dict) -> None:
    """Dtype and shape of ``a`` against ``spec``; binds the named sizes it is the first to show."""
    dtypes = _resolve(name, spec.dtype, sizes)
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    dt = getattr(a, "dtype", None)
    shape = getattr(a, "shape", None)
    if dt is None or shape is None or not any(dt == want for want in dtypes):
        raise ValueError(f"stored array {name!r} must have dtype {' or '.join(str(d) for d in dtypes)}, received {dt}")
    got = tuple(int(s) for s in shape)
    if len(got) != len(spec.shape):
        raise ValueError(f"stored array {name!r} must have {len(spec.shape)} axes, received shape {got}")
    for axis, (want, size) in enumerate(zip(spec.shape, got)):
        if isinstance(want, str) and want not in sizes:
            sizes[want] = size
            continue
        want = _resolve(name, want, sizes)
        if size != want:
            raise ValueError(f"stored array {name!r} must have {want} on axis {axis}, received shape {got}")


def _check_values(xp: Namespace, name: str, a: Array, spec: Spec, sizes: dict, floats: tuple) -> None:
    """The values of ``a``: finite (floating dtypes), inside ``[low, high]``, ascending."""
    low, high = _resolve(name, spec.low, sizes), _resolve(name, spec.high, sizes)
    if any(a.dtype == f for f in floats):
        if not _compat.all_finite(xp, [a]):
            raise ValueError(f"stored array {name!r} holds NaN or infinity")
        top = float(xp.finfo(a.dtype).max)  # a bound beyond the dtype's range holds already (and would not cast)
        low = None if low is not None and low <= -top else low
        high = None if high is not None and high >= top else high
    if math.prod(int(s) for s in a.shape) == 0:
        return
    if low is not None and bool(xp.any(a < low)):
        raise ValueError(f"stored array {name!r} holds values below {low} (smallest {_extreme(xp, a, xp.min)})")
    if high is not None and bool(xp.any(a > high)):
        raise ValueError(f"stored array {name!r} holds values above {high} (largest {_extreme(xp, a, xp.max)})")
    if spec.ascending and int(a.shape[-1]) > 1 and bool(xp.any(a[..., 1:] <= a[..., :-1])):
        raise ValueError(f"stored array {name!r} must be strictly ascending along its last axis")


def _extreme(xp: Namespace, a: Array, reduce: Callable) -> str:
    return f"{float(reduce(a)):.6g}"
