"""Memory a cache holds against what its tokens use, after a prompt and while decoding.

For each cache method and model geometry the script fills a cache with random float32 keys,
values and queries (no model weights: the bytes depend on the geometry and the method, not on
the values), then prints bits per stored value:

- ``held``: ``8 · memory_usage() / values`` (every byte the cache holds: spare room of the
  growable buffers, rollback copies, the float16 windows, calibration and fixed state);
- ``used``: ``8 · used_bytes() / values`` (the stored tokens' state, without the spare room
  and the rollback copies);
- ``rollback``: the rollback copies kept for ``truncate`` (``rollback_bytes()``);
- ``spare``: ``held − used − rollback``, the room allocated ahead of use;

where ``values = layers · 2 · kv_heads · head_dim · tokens``. ``reach`` checks that
``memory_usage()`` is honest: the bytes of every NumPy array reachable from the cache (each
buffer counted once, whatever views of it are held) must not exceed it.

Scenarios: a prompt of ``511`` tokens; a prompt of ``384`` then ``127`` decode steps; a prompt
of ``--long`` tokens (8192) then ``--steps`` decode steps (100). Geometries: SmolLM2-135M
(30 layers, 3 KV heads, head_dim 64) and Gemma-3-270M (18 layers, 1 KV head, head_dim 256,
5 of every 6 layers sliding-window layers of 512 tokens, as ``model.make_cache`` builds it)::

    python benchmarks/memory_held.py
    python benchmarks/memory_held.py --methods pqo4 dense --geometries smollm2 --long 4096
"""

from __future__ import annotations

import argparse
import json
import types
from typing import Any

import numpy as np

import arraykv
from arraykv.caches import make_cache

#: ``(layers, kv_heads, head_dim, query heads per KV head, sliding window or None)``.
GEOMETRIES = {
    "smollm2": (30, 3, 64, 3, None),
    "gemma3": (18, 1, 256, 4, 512),
}
METHODS = ("dense", "pqo2", "pqo3", "pqo4", "int4")


def build(method: str, geometry: str, **options: Any) -> Any:
    """An empty cache of ``method`` for ``geometry`` (a hybrid one where the model has windows)."""
    layers, heads, dim, _, window = GEOMETRIES[geometry]
    if window is None:
        return make_cache(method, num_layers=layers, num_kv_heads=heads, head_dim=dim, **options)
    types_ = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    return make_cache(
        "hybrid",
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        layer_types=types_,
        window=window,
        full_method=method,
        full_options=options,
    )


def fill(cache: Any, geometry: str, prompt: int, steps: int, seed: int = 0) -> int:
    """Prefill ``prompt`` random tokens into every layer, then decode ``steps``; returns the tokens."""
    layers, heads, dim, groups, _ = GEOMETRIES[geometry]
    rng = np.random.default_rng(seed)
    config = arraykv.AttendConfig(softmax_scale=dim**-0.5, n_kv_groups=groups)

    def draw(t: int, h: int = heads) -> np.ndarray:
        return rng.standard_normal((1, h, t, dim), dtype=np.float32)

    for layer in range(layers):
        cache.prefill(layer, draw(prompt), draw(prompt), draw(prompt, heads * groups))
    for _ in range(steps):
        for layer in range(layers):
            cache.decode(layer, draw(1), draw(1), draw(1, heads * groups), config)
    return prompt + steps


def reachable_nbytes(root: object) -> int:
    """Bytes of the NumPy arrays reachable from ``root``, each underlying buffer counted once."""
    seen: set[int] = set()
    owners: dict[int, np.ndarray] = {}
    stack: list[object] = [root]
    skip = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.FunctionType)
    skip += (types.BuiltinFunctionType, types.MethodType)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            owners[id(base)] = base
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif not type(obj).__module__.startswith(("numpy", "threading", "_thread", "array_api")):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for cls in type(obj).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(obj, name):
                        stack.append(getattr(obj, name))
    return sum(int(a.nbytes) for a in owners.values())


def measure(method: str, geometry: str, prompt: int, steps: int, **options: Any) -> dict[str, Any]:
    """Bits per value held, used, in rollback copies and spare after ``prompt`` + ``steps`` tokens."""
    layers, heads, dim, _, _ = GEOMETRIES[geometry]
    cache = build(method, geometry, **options)
    tokens = fill(cache, geometry, prompt, steps)
    bits = 8 / (layers * 2 * heads * dim * tokens)
    held, used = cache.memory_usage(), cache.used_bytes()
    rollback = cache.rollback_bytes() if hasattr(cache, "rollback_bytes") else 0
    reach = reachable_nbytes(cache)
    return {
        "method": method + "".join(f" {k}={v}" for k, v in options.items()),
        "geometry": geometry,
        "tokens": f"{prompt}+{steps}",
        "held": round(held * bits, 3),
        "used": round(used * bits, 3),
        "rollback": round(rollback * bits, 3),
        "spare": round((held - used - rollback) * bits, 3),
        "held/used": round(held / used, 4),
        "reach_ok": reach <= held,
    }


def main(argv: list[str] | None = None) -> None:
    """Print the table (or JSON lines with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--long", type=int, default=8192, help="prompt of the long scenario")
    p.add_argument("--steps", type=int, default=100, help="decode steps after the long prompt")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    scenarios = ((511, 0), (384, 127), (args.long, args.steps))
    cols = ("geometry", "method", "tokens", "held", "used", "rollback", "spare", "held/used", "reach_ok")
    if not args.json:
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
    for geometry in args.geometries:
        for method in args.methods:
            for prompt, steps in scenarios:
                row = measure(method, geometry, prompt, steps)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print("| " + " | ".join(str(row[c]) for c in cols) + " |", flush=True)


if __name__ == "__main__":
    main()
