"""Read-only shape properties of the quantizers' frozen dataclasses."""

from __future__ import annotations

__all__ = ["axis_length"]


def axis_length(field: str, axis: int) -> property:
    """A property returning ``int(self.<field>.shape[axis])``, the length of one axis of an array field."""
    return property(
        lambda self: int(getattr(self, field).shape[axis]), doc=f"Length of axis {axis} of ``{field}`` (int)."
    )
