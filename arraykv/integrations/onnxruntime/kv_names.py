"""The names an exported ONNX decoder gives its KV-cache inputs and outputs.

A decoder exported with its KV cache takes ``past_key_values.{i}.key`` and
``past_key_values.{i}.value`` for every layer ``i`` and returns ``present.{i}.key`` and
``present.{i}.value``. Both the ONNX Runtime hook and the graph search for the attention
queries read these names, so they live here, below both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["PAST_NAME", "PRESENT_NAME", "discover_kv_names"]

#: A past KV input: group 1 is the layer index, group 2 ``key`` or ``value``.
PAST_NAME = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
#: The present KV output of layer ``i`` and ``kind`` (``key`` or ``value``).
PRESENT_NAME = "present.{i}.{kind}"


def discover_kv_names(input_names: Sequence[str], output_names: Sequence[str]) -> int:
    """Number of layers whose ``past_key_values.{i}.key/value`` inputs and ``present.*`` outputs exist.

    Raises
    ------
    ValueError
        No KV inputs, a gap in the layer indices, or a missing ``present`` output.
    """
    found: dict[int, set[str]] = {}
    for name in input_names:
        m = PAST_NAME.match(name)
        if m:
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
    if not found:
        raise ValueError(
            "the ONNX model has no past_key_values.{i}.key/value inputs, so its KV cache cannot be "
            "managed; export the decoder with KV-cache inputs (for example Optimum's "
            "'text-generation-with-past' task). Inputs found: " + ", ".join(input_names)
        )
    n = max(found) + 1
    outs = set(output_names)
    for i in range(n):
        if found.get(i) != {"key", "value"}:
            raise ValueError(f"layer {i} lacks past_key_values.{i}.key or .value among the inputs")
        for kind in ("key", "value"):
            if PRESENT_NAME.format(i=i, kind=kind) not in outs:
                raise ValueError(f"the model has past_key_values.{i}.{kind} but no present.{i}.{kind} output")
    return n
