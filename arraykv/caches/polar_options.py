"""Options of the ``pqo``/``pq``/``tq`` caches: their defaults and their checks.

The defaults were chosen by measurement on SmolLM2-135M (``docs/algorithms.md``); every
option is checked once, here, and held in a frozen :class:`PolarOptions`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from .._validation import check_auto_bool, check_bool, check_int, check_real, check_softmax_scale
from ..quant.polar import LENGTHS
from ..quant.rotary_mean import check_rope
from ..quant.rotation import is_power_of_two
from .layer import check_decode_path
from .rollback import DEFAULT_ROLLBACK_TOKENS, check_rollback_tokens

__all__ = [
    "PolarOptions",
    "check_polar_options",
    "DEFAULT_RESIDUAL_WINDOW",
    "default_residual_window",
    "DEFAULT_SINK_TOKENS",
    "DEFAULT_OUTLIER_THRESHOLD",
    "MAX_DENSE_HEAD_DIM",
]

#: Recent tokens kept in float16 by default, by key bits (chosen by measurement, see
#: docs/algorithms.md §8): 4-bit codes are accurate enough that four more exact tokens buy
#: less than the 0.09 bits/value they cost at 512 tokens; at 3 bits and below they pay.
DEFAULT_RESIDUAL_WINDOW = {1: 24, 2: 24, 3: 24, 4: 20}
#: First tokens of a sequence kept in float16 (attention sinks; chosen by measurement).
DEFAULT_SINK_TOKENS = 4
#: A key channel is an outlier when its RMS in what is quantized, the weighted centered keys
#: ``s ⊙ (k − m_t)``, exceeds this multiple of the head's median channel RMS there. With
#: isotropic queries the weights turn a key channel ``a`` times the others into ``sqrt(a)``
#: times, so 3.5 protects key channels from about 12x up (docs/algorithms.md §5).
DEFAULT_OUTLIER_THRESHOLD = 3.5
#: Largest non-power-of-two head_dim (a dense head_dim² rotation is held).
MAX_DENSE_HEAD_DIM = 1024


def default_residual_window(key_bits: int) -> int:
    """The default ``residual_window`` for keys of ``key_bits`` MSE bits (20 from 4 bits up, else 24)."""
    return DEFAULT_RESIDUAL_WINDOW.get(int(key_bits), 20)


@dataclass(frozen=True)
class PolarOptions:
    """The checked options of a :class:`~arraykv.caches.polar.PolarCache` (see its docstring)."""

    key_bits: int
    value_bits: int
    qjl: bool
    seed: int
    residual_window: int
    center: bool | str
    outliers: int | Literal["auto"]
    outlier_threshold: float
    max_outliers: int
    key_scale: bool
    sink_tokens: int
    key_length: str
    value_length: str
    rope: dict[str, Any] | str | None
    softmax_scale: float | None
    decode_path: str
    rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS

    def config(self) -> dict[str, Any]:
        """The options as plain JSON values, by name (``qjl`` included)."""
        return asdict(self)


def check_polar_options(
    head_dim: int,
    *,
    key_bits: int,
    value_bits: int,
    qjl: bool = False,
    seed: int = 0,
    residual_window: int | None = None,
    center: bool | str = "auto",
    outliers: int | Literal["auto"] = "auto",
    outlier_threshold: float = DEFAULT_OUTLIER_THRESHOLD,
    max_outliers: int | None = None,
    key_scale: bool = True,
    sink_tokens: int = DEFAULT_SINK_TOKENS,
    key_length: str = "unbiased",
    value_length: str = "unbiased",
    rope: dict[str, Any] | str | None = "auto",
    softmax_scale: float | None = None,
    decode_path: str = "auto",
    rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
) -> PolarOptions:
    """Check every option of a polar cache with ``head_dim`` channels per head.

    Returns
    -------
    PolarOptions
        With the defaults that depend on others filled in (``residual_window``,
        ``max_outliers``) and numbers as Python ``int``/``float``.

    Raises
    ------
    ValueError, TypeError
        Naming the option and the value received.
    """
    d = head_dim
    if d < 4:
        raise ValueError(f"head_dim must be >= 4 for the rotated quantizers, received {d}")
    if not is_power_of_two(d) and d > MAX_DENSE_HEAD_DIM:
        raise ValueError(
            f"head_dim must be a power of two or at most {MAX_DENSE_HEAD_DIM} (a dense rotation is held), received {d}"
        )
    key_bits = check_int("key_bits", key_bits, low=1, high=8)
    value_bits = check_int("value_bits", value_bits, low=1, high=8)
    qjl = check_bool("qjl", qjl)
    seed = check_int("seed", seed, low=0)
    if residual_window is None:
        residual_window = default_residual_window(key_bits)
    residual_window = check_int("residual_window", residual_window, low=0)
    center = check_auto_bool("center", center)
    if outliers != "auto":
        if isinstance(outliers, str):
            raise ValueError(f"outliers must be 'auto' or an integer, received {outliers!r}")
        outliers = check_int("outliers", outliers, low=0, high=d - 1)
    outlier_threshold = check_real("outlier_threshold", outlier_threshold, low=1.0)
    max_outliers = d // 16 if max_outliers is None else check_int("max_outliers", max_outliers, low=0, high=d - 1)
    softmax_scale = None if softmax_scale is None else check_softmax_scale(softmax_scale)
    key_scale = check_bool("key_scale", key_scale)
    for name, value in (("key_length", key_length), ("value_length", value_length)):
        if not isinstance(value, str) or value not in LENGTHS:
            raise ValueError(f"{name} must be one of {', '.join(LENGTHS)}, received {value!r}")
    return PolarOptions(
        key_bits=key_bits,
        value_bits=value_bits,
        qjl=qjl,
        seed=seed,
        residual_window=residual_window,
        center=center,
        outliers=outliers,
        outlier_threshold=float(outlier_threshold),
        max_outliers=max_outliers,
        key_scale=key_scale,
        sink_tokens=check_int("sink_tokens", sink_tokens, low=0),
        key_length=key_length,
        value_length=value_length,
        rope=check_rope(rope),
        softmax_scale=softmax_scale,
        decode_path=check_decode_path(decode_path),
        rollback_tokens=check_rollback_tokens(rollback_tokens),
    )
