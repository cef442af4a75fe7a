"""Crafted cache files and snapshots: every floating array set to large, non-finite or bit-flipped values.

A *case* takes the saved state of a real cache (every method, a ``hybrid`` cache too), changes
one floating array of one layer, and either writes it as a cache file with the SHA-256
trailer recomputed (:func:`cache_files.serialize_file`) and loads it with :func:`arraykv.load`,
or gives it to :meth:`restore` as a snapshot. It ends in one of:

``refused``
    the load raised :class:`~arraykv.CacheFileError` (``restore``: ``ValueError``);
``works``
    on every layer the cache decodes three ordinary tokens (standard normal keys, values and
    queries), is truncated as far back as it can go (its rollback copies return to the window)
    and takes a 30-token prefill (every window token is encoded), every output finite;
``fails``
    it loaded, and a decode or prefill raised or returned something non-finite: what the
    checks on loading (:mod:`arraykv.caches.restore_checks`) exist to rule out.

The values tried per array (:func:`mutations`): the whole array set to 6e4, 65504, 1e4,
-6e4, the largest value its dtype holds and the first one beyond it (``inf`` for float16, the
bound of the layout checks, ``2**32``, and just above it for float32), NaN and ``inf``; one
element set to 6e4 and to 65504; and single bit flips at positions drawn with a fixed seed.
"""

from __future__ import annotations

import copy
import math
import os
import warnings

import numpy as np

import arraykv

from cache_files import parse_file, serialize_file

#: Layers of the caches crafted: layer 0 holds sinks, codes, a window, a calibration and
#: rollback copies; layer 1 a short prompt only (uncalibrated, every token exact).
LONG, SHORT = 70, 10
HEADS, HEAD_DIM = 2, 32


def targets() -> dict:
    """Every built-in method, a hybrid cache (sliding layers over a ``pqo4`` full layer) and
    sliding-window caches of float16 and ``pq4`` rows."""
    from conftest import BUILTIN_METHODS

    out = {m: {"method": m} for m in BUILTIN_METHODS}
    out["hybrid"] = {
        "method": "hybrid",
        "layer_types": ["sliding_attention", "full_attention"],
        "window": 8,
        "full_method": "pqo4",
    }
    out["window-float16"] = {"method": "window", "window": 8, "storage": "float16"}
    out["window-pq4"] = {"method": "window", "window": 8, "storage": "pq4"}
    return out


def _config(spec: dict) -> arraykv.AttendConfig:
    return arraykv.AttendConfig(softmax_scale=1.0 / math.sqrt(HEAD_DIM), n_kv_groups=2)


def build(spec: dict, dtype: str = "float32", seed: int = 0):
    """A real cache of ``spec``: layer 0 a 70-token prompt of rotary-like keys and 3 decoded
    tokens, layer 1 a 10-token prompt."""
    rng = np.random.default_rng(seed)
    cache = arraykv.make_cache(num_layers=2, num_kv_heads=HEADS, head_dim=HEAD_DIM, **spec)
    for layer, t in ((0, LONG), (1, SHORT)):
        mean = rng.standard_normal((1, HEADS, 1, HEAD_DIM)) * 2.0
        k = (mean + rng.standard_normal((1, HEADS, t, HEAD_DIM)) * 0.5).astype(dtype)
        v = rng.standard_normal((1, HEADS, t, HEAD_DIM)).astype(dtype)
        q = rng.standard_normal((1, 2 * HEADS, t, HEAD_DIM)).astype(dtype)
        cache.prefill(layer, k, v, q)
        if layer == 0:
            for _ in range(3):
                k, v = (rng.standard_normal((1, HEADS, 1, HEAD_DIM)).astype(dtype) for _ in range(2))
                q = rng.standard_normal((1, 2 * HEADS, 1, HEAD_DIM)).astype(dtype)
                cache.decode(layer, k, v, q, _config(spec))
    return cache


def mutations(a: np.ndarray, rng: np.random.Generator, flips: int) -> list:
    """``(label, array)``: the crafted versions of floating array ``a`` (see the module docstring)."""
    out = []
    fi = np.finfo(a.dtype)
    top = float(fi.max) if a.dtype == np.float16 else 2.0**32
    beyond = math.inf if a.dtype == np.float16 else float(np.nextafter(np.float32(top), np.float32(np.inf)))
    for value in (6e4, 65504.0, 1e4, -6e4, top, beyond, math.nan, math.inf):
        out.append((f"all {value:g}", np.full_like(a, value)))
    for value in (6e4, 65504.0):
        b = a.copy()
        b.reshape(-1)[int(rng.integers(a.size))] = value
        out.append((f"one {value:g}", b))
    bits = a.dtype.itemsize * 8
    raw = np.dtype(f"u{a.dtype.itemsize}")
    for _ in range(flips):
        b = a.copy()
        i, bit = int(rng.integers(a.size)), int(rng.integers(bits))
        view = b.reshape(-1).view(raw)
        view[i] ^= raw.type(1 << bit)
        out.append((f"bit {bit} of element {i}", b))
    return out


def exercise(cache, dtype: str, seed: int = 1) -> str | None:
    """None when, on every layer, three ordinary decode steps, a truncation to the shortest
    length the layer can reach (its rollback copies back in the window) and a 30-token prefill
    (longer than every window: each window token is encoded) give finite outputs; else what
    went wrong."""
    rng = np.random.default_rng(seed)
    cfg = _config({})

    def finite(*xs) -> bool:
        return all(x is None or np.isfinite(np.asarray(x, dtype=np.float64)).all() for x in xs)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for layer in range(cache.num_layers):
                for _ in range(3):
                    k, v = (rng.standard_normal((1, HEADS, 1, HEAD_DIM)).astype(dtype) for _ in range(2))
                    q = rng.standard_normal((1, 2 * HEADS, 1, HEAD_DIM)).astype(dtype)
                    out = cache.decode(layer, k, v, q, cfg)
                    got = [out.output] if isinstance(out, arraykv.Fused) else [out.result.k, out.result.v]
                    if not finite(*got):
                        return f"decode on layer {layer} is not finite"
                low = cache.min_truncate_length(layer)
                if 0 < low < cache.seq_len(layer):
                    cache.truncate(layer, low)
                k, v = (rng.standard_normal((1, HEADS, 30, HEAD_DIM)).astype(dtype) for _ in range(2))
                q = rng.standard_normal((1, 2 * HEADS, 30, HEAD_DIM)).astype(dtype)
                r = cache.prefill(layer, k, v, q)
                if not finite(r.k, r.v, r.logit_bias):
                    return f"prefill on layer {layer} is not finite"
    except Exception as exc:  # noqa: BLE001 - any failure after loading is the finding
        return f"{type(exc).__name__}: {exc}"[:200]
    return None


def _pick(cases: list, rng: np.random.Generator, sample: int | None) -> list:
    """``sample`` of ``cases`` drawn without replacement (all of them when None), in order."""
    if sample is None or sample >= len(cases):
        return cases
    keep = sorted(int(i) for i in rng.choice(len(cases), size=sample, replace=False))
    return [cases[i] for i in keep]


def file_cases(
    spec: dict, dtype: str, tmp: str, rng: np.random.Generator, flips: int, sample: int | None = None
) -> list:
    """``(what, outcome, detail)`` of the file cases of ``spec`` with layers of ``dtype``: every
    one, or ``sample`` of them drawn with ``rng``."""
    cache = build(spec, dtype)
    path = os.path.join(tmp, "base.akv")
    cache.save(path)
    with open(path, "rb") as fh:
        base = parse_file(fh.read())
    cases = [
        (j, layer, name, label, crafted)
        for j, (layer, name, a) in enumerate(base["arrays"])
        if a.dtype.kind == "f" and a.size
        for label, crafted in mutations(a, rng, flips)
    ]
    results = []
    for j, layer, name, label, crafted in _pick(cases, rng, sample):
        f = copy.deepcopy(base)
        f["arrays"][j][2] = crafted
        with open(path, "wb") as fh:
            fh.write(serialize_file(f))
        what = f"{spec['method']} {dtype} layer {layer} {name}: {label}"
        try:
            loaded = arraykv.load(path)
        except arraykv.CacheFileError as exc:
            results.append((what, "refused", str(exc)))
            continue
        bad = exercise(loaded, dtype)
        results.append((what, "fails" if bad else "works", bad or ""))
    return results


def snapshot_cases(spec: dict, dtype: str, rng: np.random.Generator, flips: int, sample: int | None = None) -> list:
    """``(what, outcome, detail)`` of the snapshot cases (:meth:`restore` of a crafted snapshot)
    of ``spec``: every one, or ``sample`` of them drawn with ``rng``."""
    cache = build(spec, dtype)
    records = cache.snapshot(host=True)
    cases = [
        (i, rec, name, label, crafted)
        for i, rec in enumerate(records)
        if rec is not None
        for name, a in rec.arrays.items()
        if a.dtype.kind == "f" and a.size
        for label, crafted in mutations(a, rng, flips)
    ]
    results = []
    for i, rec, name, label, crafted in _pick(cases, rng, sample):
        crafted_records = list(records)
        crafted_records[i] = type(rec)(
            length=rec.length, batch=rec.batch, dtype=rec.dtype, arrays={**rec.arrays, name: crafted}
        )
        target = cache.fork()
        what = f"{spec['method']} {dtype} snapshot layer {i} {name}: {label}"
        try:
            target.restore(crafted_records)
        except ValueError as exc:
            results.append((what, "refused", str(exc)))
            continue
        bad = exercise(target, dtype)
        results.append((what, "fails" if bad else "works", bad or ""))
    return results
