"""A crafted store entry that passes every check of the format and leaves no float16 room is
refused: a ``StoreWarning``, the prompt computed, the entry replaced, and ``generate`` works.

Before, one flipped bit in a float16 ``k_window`` of an entry sealed again (checksum and
envelope recomputed, as anyone who can write the store can) restored, and every later
``generate`` raised "overflow float16" until someone deleted the entry. Restoring an entry
goes through the cache's ``restore`` (:func:`arraykv.store.entry.restore_entry`), which runs
the checks of :mod:`arraykv.caches.restore_checks`.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from arraykv.store import LocalStore, PrefixStore, StoreWarning, encode_cache, segmented_prefill
from arraykv.store.binding import seal_entry

from cache_files import parse_file, serialize_file
from crafted_state import mutations

S, CHUNK = 64, 32


def _prompt(n: int) -> list:
    return np.random.default_rng(0).integers(0, 101, n).tolist()


def _sealed(store, model, ids, body: bytes, method: str) -> bytes:
    keys = store.keys(model, model.make_cache(method), ids, chunk_size=CHUNK)
    return seal_entry(store._binding(keys, ids, 1), body, store._tenant, method=method)


def _crafted_bodies(good: bytes, rng: np.random.Generator, flips: int) -> list:
    """``(what, body)``: the entry's cache file with one float16/float32 array crafted (checksum recomputed)."""
    base = parse_file(good)
    out = []
    for j, (layer, name, a) in enumerate(base["arrays"]):
        if a.dtype.kind != "f" or not a.size:
            continue
        for label, crafted in mutations(a, rng, flips):
            f = {"config": base["config"], "layers": base["layers"], "arrays": list(base["arrays"])}
            f["arrays"][j] = [layer, name, crafted]
            out.append((f"layer {layer} {name}: {label}", serialize_file(f)))
    return out


def _generate(model, ids, store, method):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model.generate(ids, 3, method=method, store=store, prefill_chunk=CHUNK, stop_at_eos=False)
    return out, [w for w in seen if issubclass(w.category, StoreWarning)]


def test_a_flipped_bit_in_a_stored_float16_window_is_refused_and_generate_works(model, tmp_path):
    ids = _prompt(S + 20)
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    key = store.keys(model, model.make_cache("pqo4"), ids, chunk_size=CHUNK)[0]
    want = model.generate(ids, 3, method="pqo4", prefill_chunk=CHUNK, stop_at_eos=False)
    fresh = model.make_cache("pqo4")
    segmented_prefill(model, ids[:S], fresh, chunk_tokens=S, chunk_size=CHUNK)
    f = parse_file(bytes(encode_cache(fresh)))
    window = next(a for layer, name, a in f["arrays"] if layer == 0 and name == "k_window")
    recent = window[0, 0, 4:]  # the recent tokens (the first 4 rows are the sinks, never encoded)
    t, c = np.argwhere((np.abs(recent) >= 0.5) & (np.abs(recent) < 1.0))[0]
    before = float(recent[t, c])
    recent[t : t + 1, c].view(np.uint16)[0] ^= np.uint16(1 << 14)  # exponent bit 4: times 2**16
    assert abs(float(recent[t, c])) == abs(before) * 2.0**16  # one channel now in [32768, 65504]
    store.backend.put(key, _sealed(store, model, ids, serialize_file(f), "pqo4"))

    got, warned = _generate(model, ids, store, "pqo4")
    assert warned and "'k_window'" in str(warned[0].message) and "layer 0" in str(warned[0].message)
    assert list(got) == list(want)
    again, warned = _generate(model, ids, store, "pqo4")  # the refused entry was replaced
    assert not warned and list(again) == list(want)
    assert store.last_report.reused == S


@pytest.mark.parametrize("method", ["pqo4", "lowrank", "int4"])
def test_crafted_entries_are_refused_or_generate_works(model, tmp_path, method):
    """Every floating array of an entry crafted (sampled: large values, NaN/inf, bit flips), sealed
    again: either the store warns and computes the prompt, or the entry restores and generates
    the right number of tokens; never an error out of ``generate``."""
    ids = _prompt(S + 20)
    cache = model.make_cache(method)
    segmented_prefill(model, ids[:S], cache, chunk_tokens=S, chunk_size=CHUNK)
    good = bytes(encode_cache(cache))
    rng = np.random.default_rng(42)
    bodies = _crafted_bodies(good, rng, flips=2)
    keep = sorted(int(i) for i in rng.choice(len(bodies), size=min(12, len(bodies)), replace=False))
    refused = worked = 0
    for i in keep:
        what, body = bodies[i]
        store = PrefixStore(LocalStore(tmp_path / f"{method}-{i}"), chunk_tokens=S)
        key = store.keys(model, model.make_cache(method), ids, chunk_size=CHUNK)[0]
        store.backend.put(key, _sealed(store, model, ids, body, method))
        try:
            got, warned = _generate(model, ids, store, method)
        except Exception as exc:  # noqa: BLE001 - the finding
            pytest.fail(f"{method} entry with {what}: generate raised {type(exc).__name__}: {exc}")
        assert len(list(got)) == 3, what
        refused += bool(warned)
        worked += not warned
    print(f"{method}: {len(keep)} crafted entries, {refused} refused, {worked} restored and generated, 0 failed")
    assert refused and refused + worked == len(keep)
