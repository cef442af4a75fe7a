"""Crafted files and snapshots either are refused at load, naming the array and layer, or work.

Before, 28 of 268 crafted files (a float16 window or mean of ``pqo4``/``tq3``/``lowrank``, or a
``lowrank`` basis, set to 6e4 with the checksum recomputed) and 13 of 375 crafted snapshots
loaded, and then every decode raised "overflow float16": each value was inside its own range,
but the state left no float16 room for the next token (:mod:`arraykv.caches.restore_checks`).

:mod:`crafted_state` makes the cases: every floating array of a real cache of every method set
to large values, NaN or infinity, or with one bit flipped, the trailer recomputed. A case
passes when the load raises ``CacheFileError`` (``restore``: ``ValueError``) naming a layer and
an array, or when the loaded cache decodes, truncates and prefills (every window token
encoded) with finite outputs. The default run samples cases with a fixed seed (about 20 s);
``-m slow`` runs every case of both dtypes. Run with ``-s`` for the counts.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

import arraykv
from arraykv.storage.cache_file import CacheFileError

from cache_files import edit_file, set_array
from crafted_state import build, exercise, file_cases, snapshot_cases, targets

TARGETS = list(targets())
#: Cases per target in the default run (files, snapshots), drawn with a fixed seed.
FILE_SAMPLE, SNAPSHOT_SAMPLE = 24, 12


def _dtype(name: str) -> str:
    """The default run alternates the layers' dtype over the targets (the slow run does both)."""
    return ("float32", "float16")[TARGETS.index(name) % 2]


def _check(results: list, label: str) -> Counter:
    counts = Counter(outcome for _, outcome, _ in results)
    failed = [f"{what}: {detail}" for what, outcome, detail in results if outcome == "fails"]
    assert not failed, f"{len(failed)} crafted {label} loaded and then failed:\n" + "\n".join(failed[:10])
    unnamed = [
        f"{what}: {detail}"
        for what, outcome, detail in results
        if outcome == "refused" and not (re.search(r"layer \d+", detail) and re.search(r"'[a-z_]+'", detail))
    ]
    assert not unnamed, "refusals that name no layer or array:\n" + "\n".join(unnamed[:10])
    print(f"{label}: {len(results)} cases, {counts['refused']} refused, {counts['works']} work, 0 load and then fail")
    return counts


@pytest.mark.parametrize("name", TARGETS)
def test_crafted_files_are_refused_or_work(name, tmp_path):
    rng = np.random.default_rng([20261128, TARGETS.index(name)])
    counts = _check(file_cases(targets()[name], _dtype(name), str(tmp_path), rng, 2, FILE_SAMPLE), f"{name} files")
    assert counts["refused"] and counts["works"]  # the cases reach both ends


@pytest.mark.parametrize("name", TARGETS)
def test_crafted_snapshots_are_refused_or_work(name):
    rng = np.random.default_rng([20261129, TARGETS.index(name)])
    _check(snapshot_cases(targets()[name], _dtype(name), rng, 2, SNAPSHOT_SAMPLE), f"{name} snapshots")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", TARGETS)
def test_every_crafted_file_and_snapshot_is_refused_or_works(name, dtype, tmp_path):
    rng = np.random.default_rng([20261130, TARGETS.index(name), dtype == "float16"])
    _check(file_cases(targets()[name], dtype, str(tmp_path), rng, 8), f"{name} {dtype} files")
    _check(snapshot_cases(targets()[name], dtype, rng, 8), f"{name} {dtype} snapshots")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", TARGETS)
def test_real_caches_load_and_work(name, dtype, tmp_path):
    """The checks refuse nothing a cache writes: every target saved after real calls loads."""
    cache = build(targets()[name], dtype, seed=5)
    cache.save(tmp_path / "c.akv")
    assert exercise(arraykv.load(tmp_path / "c.akv"), dtype) is None


# -- the cases of the issue, one by one ----------------------------------------------------------
def _saved(tmp_path, method, dtype="float32"):
    path = tmp_path / f"{method}.akv"
    build(targets()[method], dtype).save(path)
    return path


def _fill(path, layer, name, value):
    def edit(f):
        a = next(a for i, n, a in f["arrays"] if i == layer and n == name)
        set_array(f, layer, name, np.full_like(a, value))

    edit_file(path, edit)


@pytest.mark.parametrize(
    "method, name",
    [
        ("pqo4", "k_window"),
        ("pqo4", "v_window"),
        ("pqo4", "k_mean"),
        ("tq3", "v_mean"),
        ("tq3", "k_window"),
        ("lowrank", "k_window"),
        ("lowrank", "v_mean"),
    ],
)
def test_a_window_or_mean_of_6e4_is_refused_naming_it(tmp_path, method, name):
    path = _saved(tmp_path, method)
    _fill(path, 0, name, 6e4)
    with pytest.raises(CacheFileError, match=rf"layer 0 .*'{name}'.*no float16 room"):
        arraykv.load(path)


def test_a_basis_that_is_not_orthonormal_is_refused(tmp_path):
    path = _saved(tmp_path, "lowrank")

    def scale(f):
        a = next(a for i, n, a in f["arrays"] if i == 0 and n == "k_basis")
        set_array(f, 0, "k_basis", a * np.float32(1.01))

    edit_file(path, scale)
    with pytest.raises(CacheFileError, match=r"layer 0 .*'k_basis' is not orthonormal"):
        arraykv.load(path)


def test_a_flipped_bit_in_a_float16_window_is_refused(tmp_path):
    """One bit (the top exponent bit but one) of one recent key channel: 0.5..1 becomes 32768..65504."""
    path = _saved(tmp_path, "pqo4", "float16")

    def flip(f):
        a = next(a for i, n, a in f["arrays"] if i == 0 and n == "k_window")
        recent = a[0, 0, 4:]  # after the 4 sinks
        t, c = np.argwhere((np.abs(recent) >= 0.5) & (np.abs(recent) < 1.0))[0]
        recent[t : t + 1, c].view(np.uint16)[0] ^= np.uint16(1 << 14)

    edit_file(path, flip)
    with pytest.raises(CacheFileError, match=r"layer 0 .*'k_window'"):
        arraykv.load(path)


def test_tq_residual_lengths_the_codes_cannot_have_are_refused(tmp_path):
    path = _saved(tmp_path, "tq3", "float16")
    _fill(path, 0, "k_qjl_norms", 65504.0)
    with pytest.raises(CacheFileError, match=r"layer 0 .*'k_qjl_norms'"):
        arraykv.load(path)


def test_int_exact_keys_without_room_for_their_group_are_refused(tmp_path):
    path = _saved(tmp_path, "int8", "float16")
    _fill(path, 0, "k_residual", 65504.0)
    with pytest.raises(CacheFileError, match=r"layer 0 .*'k_residual'"):
        arraykv.load(path)
