"""What encoding a polar layer's tokens takes besides the tokens: one argument object.

The encode ops (``polar_encode_tokens``, ``polar_store_token``), their array-API references
and their Numba kernels all take a :class:`PolarEncoder`: the layer's calibration, the method's
fixed tables and its length rules, built once per call by the cache
(:meth:`arraykv.caches.polar.PolarCache`), unpacked into kernel scalars in one place per kernel
module. The position of the first token is passed beside it: it changes every step, the rest
only when the layer is calibrated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._types import Array

if TYPE_CHECKING:
    from .codebooks import Codebook
    from .qjl import QJLSketch
    from .rotation import Rotation

__all__ = ["PolarEncoder"]


@dataclass(frozen=True)
class PolarEncoder:
    """A polar layer's encoding state: calibration, fixed tables and length rules.

    A token's key is stored as ``s ⊙ (k − m_p)`` with the outlier channels cut out (kept in
    float16) and the rest through TurboQuant-MSE; its value as ``v − v_mean`` through
    TurboQuant-MSE (:mod:`arraykv.quant.polar_tokens`).

    Attributes
    ----------
    k_mean, v_mean, k_scale : float16 (b, h, d)
        The layer's calibration (:class:`arraykv.caches.polar_calibration.PolarCalibration`):
        the key and value means and the key channel weights ``s``.
    k_outlier_idx : int32 (b, h, n_out)
        Key channels kept exactly (``n_out`` may be 0).
    k_mean_freq : float32 (b, h, d // 2) or None
        A rotating key mean's frequencies (None: ``k_mean`` is a plain mean).
    k_mean_pairs : int32 (d // 2, 2) or None
        The channel pairs the rotating mean turns.
    k_codebook, v_codebook : Codebook
        Lloyd-Max centroids of rotated unit-vector coordinates at the key / value bits.
    rotation : Rotation
        The random rotation ``M``.
    key_unbiased, value_unbiased : bool
        Which length is stored (:func:`arraykv.quant.polar.polar_encode_reference`).
    qjl : QJLSketch or None
        With a sketch (``tq`` keys), the encode also sketches each key's residual.

    Notes
    -----
    The object holds references, never copies: building one per call costs a few
    microseconds, and the kernels memoize what they derive from the fixed tables by the
    tables' identity.
    """

    k_mean: Array
    v_mean: Array
    k_scale: Array
    k_outlier_idx: Array
    k_mean_freq: Array
    k_mean_pairs: Array
    k_codebook: Codebook
    v_codebook: Codebook
    rotation: Rotation
    key_unbiased: bool
    value_unbiased: bool
    qjl: QJLSketch | None = None

    @property
    def n_outliers(self) -> int:
        """Key channels kept exactly per head."""
        return int(self.k_outlier_idx.shape[-1])
