"""What every cache layer remembers, and the checks shared by the caches' stores and options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .. import _compat
from .._types import Array, Device, DType, Namespace

if TYPE_CHECKING:
    from ..storage import TokenBuffers

__all__ = ["LayerState", "DECODE_PATHS", "check_decode_path", "refuse_overflow"]


@dataclass
class LayerState:
    """What every layer remembers about its inputs; each cache subclasses it with its own arrays.

    Attributes
    ----------
    xp : namespace
        The array namespace of the stored arrays.
    device : device
        Their device.
    batch : int
        Batch size of the stored tokens.
    dtype : dtype
        The callers' dtype (results are returned in it).
    length : int
        Tokens stored.
    fixed_end : int
        ``length`` after the call that fixed the layer's data-dependent parameters (its
        calibration); 0 when none did (or it was given). A truncation inside that call is
        refused; one below it may return the layer to its uncalibrated state
        (:mod:`arraykv.caches.rollback`).
    fixed_known : bool
        False when ``fixed_end`` was not recorded (a layer loaded from a file written before
        the record existed): it is then the layer's length at loading, and whether a call
        made the calibration is unknown.
    """

    xp: Namespace
    device: Device
    batch: int
    dtype: DType
    length: int = 0
    fixed_end: int = 0
    fixed_known: bool = True
    #: Set by :meth:`~arraykv.caches.LayeredCache._store_tokens` once a call's tokens are in
    #: the layer's buffers (before ``length`` counts them): what a failure after it must undo.
    stored: bool = False
    #: How a failed call or transaction puts the layer back (:mod:`arraykv.caches.transaction`):
    #: ``"copy"`` (a copy of the layer, any state) or ``"fields"`` (its fields kept by reference,
    #: for a state whose arrays are token buffers, float16 blocks or arrays replaced by each store,
    #: never written in place otherwise).
    undo: ClassVar[str] = "copy"

    def buffers(self) -> tuple[TokenBuffers, ...]:
        """The growable token buffers of the layer (for :meth:`LayeredCache.reallocations`)."""
        return ()

    def mark_rows(self) -> Any:
        """For ``undo == "fields"``: what :meth:`rewind_rows` needs to put back the rows this
        state writes in place besides token buffers and sliding blocks (None: there are none)."""
        return None

    def rewind_rows(self, mark: Any) -> None:
        """Write back the rows :meth:`mark_rows` recorded, after the fields were restored."""


#: ``decode_path`` values of the caches with a fused decode: attend from the stored form where
#: a kernel makes it pay ("auto"), always ("fused"; the array-API version where no kernel
#: exists), or never: reconstruct the layer for the caller ("dequantized").
DECODE_PATHS = ("auto", "fused", "dequantized")


def check_decode_path(value: object) -> str:
    """``value`` if it is one of :data:`DECODE_PATHS`, else a ``ValueError`` naming them."""
    if not isinstance(value, str) or value not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {', '.join(DECODE_PATHS)}, received {value!r}")
    return value


def refuse_overflow(xp: Namespace, method: str, arrays: dict[str, Array | list[Array] | None]) -> None:
    """Raise ``ValueError`` when an array about to be stored holds infinity (float16 overflow).

    The float16 parts of a compressed cache (windows, sinks, lengths, outlier channels, means,
    coefficients) hold magnitudes up to 65504; a finite float32 input beyond that would be
    stored as inf and poison every later decode. Called on what a store computed (``arrays``:
    by name, an array, None, or a list of arrays that are the parts of one store), before it
    commits anything, so the refused call leaves the layer as it was. The floating arrays are
    checked together (:func:`arraykv._compat.all_finite`); only a failing check looks for the
    name to report.
    """
    floats = _compat.float_dtypes(xp)
    named = [
        (name, a)
        for name, value in arrays.items()
        for a in (value if isinstance(value, list) else [value])
        if a is not None and a.dtype in floats
    ]
    if _compat.all_finite(xp, [a for _, a in named]):
        return
    name = next(name for name, a in named if not _compat.all_finite(xp, [a]))
    raise ValueError(
        f"these keys/values overflow the float16 {name!r} of method {method!r} (magnitudes above 65504, "
        f"after centering and channel weights); scale them down, or use method 'dense' or an int method "
        f"('int8', 'int4', 'int2', which hold any magnitude)"
    )
