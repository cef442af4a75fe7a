"""A fuzzer of hostile cache files and snapshots: every case is refused or loads a working cache.

For every method (plus a ``hybrid`` cache and ``window`` caches of float16 and ``pq4``
storage) a worker process builds small caches (2 layers, 2 KV heads, head_dim 32 and 24,
batch 1 and 2, float32 and float16, a truncated one and option variants: outlier channels,
a codebook of 12, float32 coefficients or scales; enough tokens that sinks, codes, windows,
calibration and rollback copies all exist, and a second layer still uncalibrated), saves
them, and runs cases. A *file case* mutates one of the files (sometimes twice): a layer's
header (length, batch, dtype, a layer emptied or filled), a configuration key (geometry,
``max_tokens``, bits, ranks, codebooks, windows, the method itself), an array's shape (with
the byte counts and offsets kept consistent), dtype or values (random bytes into codes and
indices, extreme integers, NaN, infinity, huge, zero and subnormal floats), an array dropped
or added, or a layer taken from a cache of another geometry; then it recomputes the SHA-256
trailer, so the file is well-formed. The case passes when :func:`arraykv.load` raises
:class:`~arraykv.CacheFileError`, or returns a cache whose ``dequantize`` of every layer
and ``decode`` of one random token on every layer (that is not full) are finite. A *restore
case* gives :meth:`restore` mutated snapshots, or snapshots of a cache of another geometry
(other ``num_kv_heads``, ``head_dim``, a batch the arrays do not have); it passes with a
``ValueError`` that leaves the cache as it was (the geometry cases must raise), or with a
working cache. Anything else fails: another exception, a ``MemoryError``, a non-finite
result, or a worker killed by a signal (recorded as a crash of the case it was running; a
new worker goes on after it).

Cases are reproducible: case ``i`` of a target draws from ``default_rng([seed, target, i])``.
``ARRAYKV_FUZZ_CASES`` sets the number of cases over all targets (default 432, about 30 s on
two cores, most of it the workers' start; 5000 take about 40 s), ``ARRAYKV_FUZZ_SEED`` the
seed; run with ``-s`` to see the counts.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
import zlib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from cache_files import parse_file, serialize_file

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
CASES = int(os.environ.get("ARRAYKV_FUZZ_CASES", "432"))
SEED = int(os.environ.get("ARRAYKV_FUZZ_SEED", "20240611"))
#: Every case of a worker together may take this long (seconds, plus start-up) before the case
#: it is running is recorded as a hang.
CASE_SECONDS = 20.0
MARK = "FUZZ "

#: Outcomes that pass. ``token-refused`` does not: the loaded cache refused the random token with
#: its own float16-overflow ``ValueError`` (a window or mean near ±65504 cannot take a token near
#: 0 in float16), so it loaded and then fails every call; loading refuses such a state now
#: (:mod:`arraykv.caches.restore_checks`).
PASS = ("refused", "loaded", "restore-refused", "restored")
#: The messages of those refusals (:func:`arraykv.caches.layer.refuse_overflow`, the int caches' units).
OVERFLOW_REFUSALS = ("overflow the float16", "beyond what this layer's float16")


def _targets() -> dict:
    # the methods arraykv itself registers (conftest lists them before any test registers its own:
    # a method a test module registers does not exist in the worker processes)
    from conftest import BUILTIN_METHODS

    out = {m: {"method": m} for m in BUILTIN_METHODS}
    out["hybrid"] = {
        "method": "hybrid",
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "window": 8,
        "full_method": "pqo4",
    }
    out["window-float16"] = {"method": "window", "window": 8, "storage": "float16"}
    out["window-pq4"] = {"method": "window", "window": 8, "storage": "pq4"}
    return out


# -- the caches a target's cases start from ------------------------------------------------
def _variant(method: str) -> dict:
    """Options of the variant base of a method: the arrays its defaults do not make."""
    if method in ("dense", "hybrid", "window"):
        return {}
    if method.startswith("int"):
        return {"scale_dtype": "float32"}
    if method == "lowrank":
        return {"coeff_dtype": "float32"}
    if method == "vq":
        return {"codebook_size": 12}
    return {"outliers": 2}


def _rotary_keys(rng, b: int, h: int, t: int, d: int) -> np.ndarray:
    """Keys of a rotary model: a per-head mean turned to each position, plus noise (half layout)."""
    x = rng.standard_normal((b, h, 1, d)) * 2.0 + rng.standard_normal((b, h, t, d)) * 0.5
    ang = np.arange(t)[:, None] * 10000.0 ** (-2.0 * np.arange(d // 2) / d)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    lo, hi = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([lo * c - hi * s, hi * c + lo * s], axis=-1)


def _make(spec: dict, *, heads: int = 2, head_dim: int = 32, **extra):
    import arraykv

    opts = dict(spec, **extra)
    layers = 3 if opts["method"] == "hybrid" else 2
    return arraykv.make_cache(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, **opts)


def _fill(cache, rng, batch: int, dtype: str, truncate: int = 0):
    """Every layer but the last: a 70-token prompt and 6 decoded tokens; the last: a 10-token
    prompt (uncalibrated, unfitted)."""
    import arraykv

    h, d = cache.num_kv_heads, cache.head_dim
    for layer in range(cache.num_layers):
        short = layer == cache.num_layers - 1
        t = 10 if short else 70
        k = _rotary_keys(rng, batch, h, t, d).astype(dtype)
        v = rng.standard_normal((batch, h, t, d)).astype(dtype)
        q = rng.standard_normal((batch, 2 * h, t, d)).astype(dtype)
        cache.prefill(layer, k, v, q)
        if not short:
            for _ in range(6):
                k, v = (rng.standard_normal((batch, h, 1, d)).astype(dtype) for _ in range(2))
                q = rng.standard_normal((batch, 2 * h, 1, d)).astype(dtype)
                cache.decode(layer, k, v, q, arraykv.AttendConfig(softmax_scale=1.0 / math.sqrt(d), n_kv_groups=2))
    if truncate:
        cache.truncate(0, cache.seq_len(0) - truncate)
    return cache


def _bases(spec: dict, rng) -> list:
    """``(label, cache)``: the caches a target's cases start from."""
    method = spec["method"]
    out = []
    for label, batch, d, dtype, extra, cut in (
        ("b1-d32", 1, 32, "float32", {}, 0),
        ("b2-d32", 2, 32, "float32", {}, 0),
        ("b1-d24", 1, 24, "float32", {}, 0),
        ("b2-d24-f16", 2, 24, "float16", {}, 0),
        ("b1-d32-variant", 1, 32, "float32", _variant(method), 3),
    ):
        cache = _make(spec, head_dim=d, **extra)
        out.append((label, _fill(cache, rng, batch, dtype, cut)))
    return out


# -- files as structures (tests/cache_files.py) ------------------------------------------------
def _from_records(config: dict, records: list) -> dict:
    """The structure of a snapshot (:mod:`cache_files`), so that restore cases mutate it as file cases do."""
    layers, arrays = [], []
    for i, rec in enumerate(records):
        if rec is None:
            layers.append(None)
            continue
        layers.append({"length": rec.length, "batch": rec.batch, "dtype": rec.dtype, "arrays": list(rec.arrays)})
        arrays += [[i, n, np.array(a)] for n, a in rec.arrays.items()]
    return {"config": copy.deepcopy(config), "layers": layers, "arrays": arrays}


def _to_records(f: dict) -> list:
    from arraykv.storage.cache_file import LayerRecord

    out = []
    for i, meta in enumerate(f["layers"]):
        if meta is None:
            out.append(None)
            continue
        arrays = {n: a for layer, n, a in f["arrays"] if layer == i}
        out.append(
            LayerRecord(length=meta.get("length"), batch=meta.get("batch"), dtype=meta.get("dtype"), arrays=arrays)
        )
    return out


# -- mutations -------------------------------------------------------------------------------
_INT_VALUES = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    12,
    16,
    20,
    24,
    31,
    33,
    48,
    64,
    100,
    1000,
    4096,
    4097,
    1 << 20,
    1 << 31,
    1 << 40,
    1 << 62,
    -1,
    -2,
    -(1 << 31),
]
_ODD_VALUES = [None, True, False, "x", "auto", "float16", "float32", 1.5, -0.5, 1e300, [], {}, [1, 2], {"a": 1}]
_EXTRA_NAMES = [
    "k",
    "v",
    "exp",
    "k_qjl",
    "k_qjl_norms",
    "k_outliers",
    "k_outlier_idx",
    "v_window",
    "k_window",
    "k_sink",
    "k_mean_freq",
    "k_mean_pairs",
    "fixed_end",
    "k_tail",
    "k_centroids",
    "k_basis",
    "k_coef",
    "k_residual",
    "k_rollback",
    "k_codes",
    "v_codes",
    "junk",
]
_DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "uint32", "int64", "float16", "float32", "float64", "bool"]


def _held(f: dict) -> list:
    return [i for i, meta in enumerate(f["layers"]) if meta is not None]


def _pick_array(rng, f: dict):
    return f["arrays"][int(rng.integers(len(f["arrays"])))] if f["arrays"] else None


def _int_like(rng, current):
    pool = list(_INT_VALUES)
    if isinstance(current, int) and not isinstance(current, bool):
        pool += [current + 1, current - 1, current * 2, current // 2, current + int(rng.integers(2, 40))] * 3
    return pool[int(rng.integers(len(pool)))]


def _any_value(rng, current):
    if rng.random() < 0.8:
        return _int_like(rng, current)
    return _ODD_VALUES[int(rng.integers(len(_ODD_VALUES)))]


def m_layer_field(rng, f, ctx):
    held = _held(f)
    if not held:
        return m_config(rng, f, ctx)
    i = held[int(rng.integers(len(held)))]
    meta = f["layers"][i]
    field = ("length", "batch", "dtype")[int(rng.integers(3))]
    if field == "dtype":
        meta["dtype"] = ["float16", "float32", "float64", "bfloat16", "int32", "uint8"][int(rng.integers(6))]
    else:
        meta[field] = _any_value(rng, meta[field])
    return f"layer {i} {field}={meta[field]!r}"


def m_layer_presence(rng, f, ctx):
    i = int(rng.integers(len(f["layers"])))
    if f["layers"][i] is None:
        held = _held(f)
        if not held:
            return m_config(rng, f, ctx)
        f["layers"][i] = copy.deepcopy(f["layers"][held[0]])
        return f"layer {i} given layer {held[0]}'s header"
    f["layers"][i] = None
    if rng.random() < 0.5:
        f["arrays"] = [e for e in f["arrays"] if e[0] != i]
    return f"layer {i} emptied"


def _config_keys(config: dict) -> list:
    keys = [k for k in config if k != "method"]
    return keys + ["num_kv_heads", "head_dim", "max_tokens"] * 2 + ["method"]


def m_config(rng, f, ctx):
    import arraykv

    cfg = f["config"]
    target = cfg
    if cfg.get("method") == "hybrid" and rng.random() < 0.4:
        target = cfg.setdefault(["full_options", "window_options"][int(rng.integers(2))], {})
        pool = [
            "key_bits",
            "value_bits",
            "residual_window",
            "sink_tokens",
            "rollback_tokens",
            "outliers",
            "storage",
            "exact_tail",
            "seed",
            "qjl",
            "max_outliers",
        ]
        key = pool[int(rng.integers(len(pool)))]
    else:
        keys = _config_keys(cfg)
        key = keys[int(rng.integers(len(keys)))]
    if key == "method":
        names = arraykv.available_methods() + ["polar", "int", "window", "hybrid", "nope"]
        target[key] = names[int(rng.integers(len(names)))]
    elif key == "storage":
        target[key] = ["float16", "exact", "pq2", "pq3", "pq4", "x"][int(rng.integers(6))]
    elif rng.random() < 0.1:
        target.pop(key, None)
        return f"config {key} removed"
    else:
        target[key] = _any_value(rng, target.get(key))
    return f"config {key}={target.get(key)!r}"


def _resized(a: np.ndarray, axis: int, n: int) -> np.ndarray:
    """``a`` with ``n`` entries along ``axis``: its own, cycled (zeros where it has none)."""
    s = a.shape[axis]
    if s == 0:
        shape = list(a.shape)
        shape[axis] = n
        return np.zeros(shape, dtype=a.dtype)
    return np.take(a, np.arange(n) % s, axis=axis)


def m_shape(rng, f, ctx):
    e = _pick_array(rng, f)
    if e is None:
        return m_config(rng, f, ctx)
    a = e[2]
    if a.ndim == 0 or rng.random() < 0.15:  # another number of axes, the same bytes
        e[2] = a.reshape(a.shape + (1,)) if rng.random() < 0.5 or a.ndim < 2 else a.reshape(a.shape[:-2] + (-1,))
        return f"{e[1]} of layer {e[0]} reshaped to {e[2].shape}"
    axis = int(rng.integers(a.ndim))
    s = a.shape[axis]
    n = [s + 1, s - 1, 0, 2 * s, s + int(rng.integers(2, 9)), max(1, s // 2)][int(rng.integers(6))]
    e[2] = _resized(a, axis, max(0, n))
    return f"{e[1]} of layer {e[0]} axis {axis}: {s} -> {max(0, n)}"


def m_dtype(rng, f, ctx):
    e = _pick_array(rng, f)
    if e is None:
        return m_config(rng, f, ctx)
    dt = np.dtype(_DTYPES[int(rng.integers(len(_DTYPES)))])
    a = e[2]
    if rng.random() < 0.5 and a.nbytes % dt.itemsize == 0 and a.ndim and (a.shape[-1] * a.itemsize) % dt.itemsize == 0:
        e[2] = a.view(dt)  # the same bytes read as another dtype
        how = "viewed"
    else:
        with np.errstate(all="ignore"):
            e[2] = a.astype(dt)
        how = "cast"
    return f"{e[1]} of layer {e[0]} {how} as {dt}"


def m_values(rng, f, ctx):
    live = [e for e in f["arrays"] if e[2].size]
    if not live:
        return m_shape(rng, f, ctx)
    e = live[int(rng.integers(len(live)))]
    a = e[2].copy()
    flat = a.reshape(-1)
    if a.dtype.kind == "f":
        fi = np.finfo(a.dtype)
        pool = [np.nan, np.inf, -np.inf, float(fi.max), -float(fi.max), float(fi.smallest_subnormal), 0.0, -1.0]
        if float(fi.max) > 1e30:
            pool += [1e30, -1e30]
        value = pool[int(rng.integers(len(pool)))]
        if rng.random() < 0.3:
            flat[:] = value
            where = "all"
        else:
            idx = rng.integers(flat.size, size=int(rng.integers(1, 4)))
            flat[idx] = value
            where = f"{len(idx)}"
        e[2] = a
        return f"{e[1]} of layer {e[0]}: {where} set to {value!r}"
    if a.dtype.kind in "iu" and rng.random() < 0.5:
        ii = np.iinfo(a.dtype)
        pool = [ii.max, ii.min, -1 if ii.min < 0 else ii.max - 1, 1 << min(ii.bits - 2, 40), ii.max // 2]
        value = pool[int(rng.integers(len(pool)))]
        idx = rng.integers(flat.size, size=int(rng.integers(1, 4)))
        flat[idx] = value
        e[2] = a
        return f"{e[1]} of layer {e[0]}: {len(idx)} set to {value}"
    raw = rng.integers(0, 256, size=a.nbytes, dtype=np.uint8)
    e[2] = raw.view(a.dtype).reshape(a.shape) if a.dtype.kind != "b" else raw.astype(bool).reshape(a.shape)
    return f"{e[1]} of layer {e[0]}: random bytes"


def m_token_count(rng, f, ctx):
    """Every array of a layer with one token count (axis 2) resized together, the length too
    or not: the sizes stay consistent with each other, so only the rules between them refuse."""
    held = [i for i in _held(f) if any(e[0] == i and e[2].ndim >= 3 for e in f["arrays"])]
    if not held:
        return m_shape(rng, f, ctx)
    i = held[int(rng.integers(len(held)))]
    counts = sorted({e[2].shape[2] for e in f["arrays"] if e[0] == i and e[2].ndim >= 3})
    s = counts[int(rng.integers(len(counts)))]
    delta = [1, -1, 2, -2, 5, -s, 16][int(rng.integers(7))]
    n = max(0, s + delta)
    for e in f["arrays"]:
        if e[0] == i and e[2].ndim >= 3 and e[2].shape[2] == s:
            e[2] = _resized(e[2], 2, n)
    moved = rng.random() < 0.6
    if moved:
        f["layers"][i]["length"] += n - s
    return f"layer {i}: arrays of {s} tokens now {n}{', length too' if moved else ''}"


def m_drop(rng, f, ctx):
    e = _pick_array(rng, f)
    if e is None:
        return m_config(rng, f, ctx)
    f["arrays"].remove(e)
    meta = f["layers"][e[0]]
    if meta is not None and rng.random() < 0.85:
        meta["arrays"] = [n for n in meta["arrays"] if n != e[1]]
    return f"{e[1]} of layer {e[0]} dropped"


def m_extra(rng, f, ctx):
    held = _held(f)
    if not held:
        return m_config(rng, f, ctx)
    i = held[int(rng.integers(len(held)))]
    names = [n for n in _EXTRA_NAMES if n not in f["layers"][i]["arrays"]]
    name = names[int(rng.integers(len(names)))]
    donor = _pick_array(rng, f)
    a = donor[2].copy() if donor is not None else np.zeros((1,), np.int64)
    f["arrays"].append([i, name, a])
    f["layers"][i]["arrays"].append(name)
    return f"{name} (a copy of {donor[1] if donor else 'zeros'}) added to layer {i}"


def m_swap_layer(rng, f, ctx):
    """A layer (header and arrays) of a cache of another geometry (batch, head_dim, dtype)."""
    other = ctx["files"][int(rng.integers(len(ctx["files"])))]
    held = [i for i in _held(other) if i < len(f["layers"])]
    if not held:
        return m_config(rng, f, ctx)
    i = held[int(rng.integers(len(held)))]
    f["layers"][i] = copy.deepcopy(other["layers"][i])
    f["arrays"] = [e for e in f["arrays"] if e[0] != i] + [
        [i, n, a.copy()] for layer, n, a in other["arrays"] if layer == i
    ]
    return f"layer {i} taken from base {other['label']}"


MUTATIONS = [
    (m_layer_field, 3),
    (m_layer_presence, 1),
    (m_config, 4),
    (m_shape, 3),
    (m_token_count, 2),
    (m_dtype, 2),
    (m_values, 5),
    (m_drop, 2),
    (m_extra, 1),
    (m_swap_layer, 1),
]
#: What a restore case mutates (configuration keys are not part of a snapshot).
RESTORE_MUTATIONS = [(m, w) for m, w in MUTATIONS if m not in (m_config, m_layer_presence)]


def _choose(rng, table):
    weights = np.array([w for _, w in table], dtype=float)
    return table[int(rng.choice(len(table), p=weights / weights.sum()))][0]


# -- running a case ------------------------------------------------------------------------
def _finite(*arrays) -> bool:
    return all(a is None or bool(np.isfinite(np.asarray(a, dtype=np.float64)).all()) for a in arrays)


def _exercise(cache, rng) -> str | None:
    """None when ``dequantize`` of every layer and ``decode`` of one token on every layer that
    is not full are finite, else what is not. Then a layer that can go back goes to its
    shortest reachable length and decodes again (the rollback copies and counts in use)."""
    records = cache.snapshot()
    for i, rec in enumerate(records):
        got = cache.dequantize(i)
        if got is not None and not _finite(got.k, got.v, got.logit_bias):
            return f"dequantize({i}) is not finite"
        b, dt = (1, "float32") if rec is None else (rec.batch, rec.dtype)
        bad = _decode_one(cache, rng, i, b, dt)
        if bad:
            return bad
        n, low = cache.seq_len(i), cache.min_truncate_length(i)
        if 0 < low < n:
            cache.truncate(i, low)
            bad = _decode_one(cache, rng, i, b, dt)
            if bad:
                return f"after truncate({i}, {low}): {bad}"
    return None


def _decode_one(cache, rng, i: int, b: int, dt: str) -> str | None:
    import arraykv

    if cache.max_tokens is not None and cache.seq_len(i) >= cache.max_tokens:
        return None
    h, d = cache.num_kv_heads, cache.head_dim
    k, v = (rng.standard_normal((b, h, 1, d)).astype(dt) for _ in range(2))
    q = rng.standard_normal((b, 2 * h, 1, d)).astype(dt)
    out = cache.decode(i, k, v, q, arraykv.AttendConfig(softmax_scale=1.0 / math.sqrt(d), n_kv_groups=2))
    if isinstance(out, arraykv.Fused):
        ok = _finite(out.output)
    else:
        ok = _finite(out.result.k, out.result.v, out.result.logit_bias)
    return None if ok else f"decode({i}) is not finite"


def _state(cache) -> list:
    return [
        (cache.seq_len(i), {n: np.array(a) for n, a in (rec.arrays.items() if rec is not None else ())})
        for i, rec in enumerate(cache.snapshot(host=True))
    ]


def _same_state(a: list, b: list) -> bool:
    def same(x, y):
        return x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")

    return len(a) == len(b) and all(
        la == lb and sorted(da) == sorted(db) and all(same(da[n], db[n]) for n in da)
        for (la, da), (lb, db) in zip(a, b)
    )


def _file_case(rng, ctx, tmp: str) -> tuple:
    import arraykv

    base = ctx["files"][int(rng.integers(len(ctx["files"])))]
    f = copy.deepcopy({k: base[k] for k in ("config", "layers", "arrays")})
    what = [base["label"]]
    for _ in range(2 if rng.random() < 0.2 else 1):
        what.append(_choose(rng, MUTATIONS)(rng, f, ctx))
    path = os.path.join(tmp, "case.akv")
    with open(path, "wb") as fh:
        fh.write(serialize_file(f))
    try:
        cache = arraykv.load(path)
    except arraykv.CacheFileError:
        return "refused", what, ""
    except MemoryError as exc:
        return "memory-error", what, f"load: {exc}"
    except Exception as exc:  # noqa: BLE001 - every other exception is what the fuzzer reports
        return "load-error", what, f"{type(exc).__name__}: {exc}"[:300]
    return _use(cache, rng, what, "loaded")


def _use(cache, rng, what: list, ok: str) -> tuple:
    """The outcome of :func:`_exercise` on a loaded or restored cache (``ok`` when it passes)."""
    try:
        bad = _exercise(cache, rng)
    except MemoryError as exc:
        return "memory-error", what, f"use: {exc}"
    except ValueError as exc:
        if any(m in str(exc) for m in OVERFLOW_REFUSALS):
            return "token-refused", what, str(exc)[:200]
        return "use-error", what, f"ValueError: {exc}"[:300]
    except Exception as exc:  # noqa: BLE001 - every other exception is what the fuzzer reports
        return "use-error", what, f"{type(exc).__name__}: {exc}"[:300]
    return ("non-finite", what, bad) if bad else (ok, what, "")


def _restore_case(rng, ctx) -> tuple:
    label, cache = ctx["bases"][int(rng.integers(len(ctx["bases"])))]
    target = cache.fork()
    before = _state(target)
    geometry = rng.random() < 0.3
    if geometry:  # a snapshot of another geometry: must be refused
        kind = ("heads", "head_dim", "batch")[int(rng.integers(3))]
        if kind == "batch":
            records = [
                None if r is None else type(r)(length=r.length, batch=r.batch + 1, dtype=r.dtype, arrays=r.arrays)
                for r in cache.snapshot()
            ]
        else:
            records = ctx["donors"][kind].snapshot()
        what = [label, f"restore of a snapshot with other {kind}"]
    else:
        f = _from_records(cache.get_config(), cache.snapshot(host=True))
        f["label"] = label
        what = [label, "restore: " + _choose(rng, RESTORE_MUTATIONS)(rng, f, ctx)]
        records = _to_records(f)
    try:
        target.restore(records)
    except ValueError:
        if not _same_state(_state(target), before):
            return "restore-changed", what, "a refused restore changed the cache"
        return "restore-refused", what, ""
    except MemoryError as exc:
        return "memory-error", what, f"restore: {exc}"
    except Exception as exc:  # noqa: BLE001
        return "restore-error", what, f"{type(exc).__name__}: {exc}"[:300]
    if geometry:
        return "restore-accepted", what, "a snapshot of another geometry was accepted"
    return _use(target, rng, what, "restored")


def _context(name: str, tmp: str) -> dict:
    """The bases of target ``name``, their files (as structures) and the donors of the geometry cases."""
    spec = _targets()[name]
    rng = np.random.default_rng([SEED, zlib.crc32(name.encode()), 1 << 30])
    bases = _bases(spec, rng)
    files = []
    for label, cache in bases:
        path = os.path.join(tmp, f"{label}.akv")
        cache.save(path)
        with open(path, "rb") as fh:
            f = parse_file(fh.read())
        f["label"] = label
        files.append(f)
    donors = {
        "heads": _fill(_make(spec, heads=3), rng, 1, "float32"),  # the bases have 2 heads, head_dim 32 or 24
        "head_dim": _fill(_make(spec, head_dim=16), rng, 1, "float32"),
    }
    return {"bases": bases, "files": files, "donors": donors}


def worker(name: str, start: int, stop: int) -> None:
    """Run cases ``start .. stop - 1`` of target ``name``, one line on stdout before and after each."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ctx = _context(name, tmp)
        for i in range(start, stop):
            print(MARK + json.dumps({"case": i, "start": True}), flush=True)
            rng = np.random.default_rng([SEED, zlib.crc32(name.encode()), i])
            try:
                if rng.random() < 0.25:
                    outcome, what, detail = _restore_case(rng, ctx)
                else:
                    outcome, what, detail = _file_case(rng, ctx, tmp)
            except Exception as exc:  # noqa: BLE001 - a failure of the case harness is reported too
                outcome, what, detail = "harness-error", [], f"{type(exc).__name__}: {exc}"[:300]
            print(MARK + json.dumps({"case": i, "outcome": outcome, "what": what, "detail": detail}), flush=True)


def run_target(name: str, cases: int) -> list:
    """Every case's result of target ``name``: workers in subprocesses, restarted after a crash."""
    results, start = [], 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, TESTS, os.environ.get("PYTHONPATH", "")]))
    while start < cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, str(start), str(cases)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
        try:
            out, err = proc.communicate(timeout=60.0 + CASE_SECONDS * (cases - start))
            hung = False
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            hung = True
        running = None
        for line in out.splitlines():
            if not line.startswith(MARK):
                continue
            rec = json.loads(line[len(MARK) :])
            if rec.get("start"):
                running = rec["case"]
            else:
                results.append(rec)
                running = None
                start = rec["case"] + 1
        if running is None and not hung and proc.returncode == 0:
            break
        if running is None:  # died before its first case: the set-up failed
            results.append(
                {
                    "case": start,
                    "outcome": "worker-error",
                    "what": [],
                    "detail": f"exit {proc.returncode}: {err[-2000:]}",
                }
            )
            break
        why = "hang" if hung else ("crash" if proc.returncode < 0 else "worker-error")
        results.append(
            {"case": running, "outcome": why, "what": [], "detail": f"exit {proc.returncode}: {err[-1500:]}"}
        )
        start = running + 1
    return results


_RESULTS: dict = {}
_LOCK = threading.Lock()


@pytest.fixture(scope="module")
def fuzz_results():
    """Every target's results, the targets run two at a time."""
    with _LOCK:
        if not _RESULTS:
            names = list(_targets())
            per = max(1, CASES // len(names))
            with ThreadPoolExecutor(max_workers=2) as pool:
                for name, res in zip(names, pool.map(lambda n: run_target(n, per), names)):
                    _RESULTS[name] = res
            _report(_RESULTS)
    return _RESULTS


def _report(results: dict) -> None:
    total = Counter()
    for name, res in results.items():
        counts = Counter(r["outcome"] for r in res)
        total.update(counts)
        print(
            f"{name:16s} {sum(counts.values()):5d} cases  " + "  ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        )
    print(f"{'all':16s} {sum(total.values()):5d} cases  " + "  ".join(f"{k}={v}" for k, v in sorted(total.items())))


@pytest.mark.parametrize("name", list(_targets()))
def test_hostile_files_and_snapshots_are_refused_or_load_a_working_cache(fuzz_results, name):
    res = fuzz_results[name]
    assert res, f"no case ran for {name}"
    bad = [r for r in res if r["outcome"] not in PASS]
    assert not bad, "\n".join(
        f"case {r['case']}: {r['outcome']}: {' / '.join(r['what'])}: {r['detail']}" for r in bad[:10]
    )
    outcomes = Counter(r["outcome"] for r in res)
    assert outcomes["refused"] + outcomes["restore-refused"] > 0  # the cases do reach the checks


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--worker":
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
