"""Who can write the store cannot change what another prompt computes: entries bound to their key, tenants apart.

The attacks are those of a writer of the store (``backend.put`` under any key, as anyone who can
write the folder or reach the server can): another prompt's entry put under a victim's key, bit
flips with the cache file's checksum recomputed, another tenant's entries, forged or missing
tags. Each is run through ``PrefixStore.prefill`` on both backends (a folder and a real Valkey
server) and must end with the victim's logits equal to a run without a store, a
``StoreWarning``, and the bad entry replaced by the good one.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time
import warnings

import numpy as np
import pytest

from arraykv.store import LocalStore, PrefixStore, StoreWarning, segmented_prefill
from arraykv.store.binding import SECRET_ENV, Tenant, open_entry, read_header, seal_entry
from arraykv.store.keys import model_identity, onnx_identity, onnx_identity_later

from tiny_models import hf_llama, store_model, store_prompt

S, CHUNK = 64, 32  # tokens per stored segment, the decoder's prefill chunk within a segment
SECRET = b"tenant-a: 0123456789abcdef"
OTHER = b"tenant-b: fedcba9876543210"
_DIGEST = 32  # the cache file's SHA-256 trailer


def keys(store, model, ids) -> list:
    return store.keys(model, model.make_cache("pqo4"), ids, chunk_size=CHUNK)


def run(store, model, ids):
    return store.prefill(model, ids, model.make_cache("pqo4"), chunk_size=CHUNK)


def no_store(model, ids):
    return segmented_prefill(model, ids, model.make_cache("pqo4"), chunk_tokens=S, chunk_size=CHUNK)


def run_quietly(store, model, ids):
    """A prefill that must not warn (the entries it meets are good)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return run(store, model, ids)


def body_offset(entry: bytes) -> int:
    """Where an entry's body (the cache file) starts: prefix, header, tag."""
    (hlen,) = struct.unpack_from("<Q", entry, 12)
    return 20 + hlen + 32


def with_trailer(cache_file: bytearray) -> bytes:
    """``cache_file`` with its SHA-256 trailer recomputed, as anyone who edits it can."""
    import hashlib

    cache_file[-_DIGEST:] = hashlib.sha256(bytes(cache_file[:-_DIGEST])).digest()
    return bytes(cache_file)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unkeyed", "keyed"])
def test_another_prompts_entry_under_the_victims_key_is_never_used(model, backend, secret):
    store = PrefixStore(backend, chunk_tokens=S, secret=secret)
    victim, other = store_prompt(S + 20), store_prompt(S + 20, seed=7)
    run(store, model, other)  # the other prompt, stored honestly by the same tenant
    k_victim, k_other = keys(store, model, victim)[0], keys(store, model, other)[0]
    backend.put(k_victim, bytes(backend.get(k_other)), tokens=S)  # as any writer can
    want = no_store(model, victim)
    with pytest.warns(StoreWarning, match="another key"):
        got = run(store, model, victim)
    assert store.last_report.reused == 0 and np.array_equal(got, want)
    assert store.last_report.stored == [S]  # the foreign entry replaced by the victim's own
    assert np.array_equal(run_quietly(store, model, victim), want) and store.last_report.reused == S


def test_a_forged_binding_is_refused_with_a_secret(model, backend):
    """With a secret, even a writer who knows the victim's binding cannot make an entry pass."""
    store = PrefixStore(backend, chunk_tokens=S, secret=SECRET)
    victim, other = store_prompt(S + 20), store_prompt(S + 20, seed=7)
    run(store, model, other)
    k_other = keys(store, model, other)[0]
    stolen = bytes(backend.get(k_other))
    body = stolen[body_offset(stolen) :]  # the other prompt's cache, whole
    forged = store._binding(keys(store, model, victim), victim, 1)  # the victim's binding, exactly
    want = no_store(model, victim)
    for tenant, why in ((Tenant(None), "carries no tag"), (Tenant(OTHER), "wrong tag")):
        backend.put(forged.key, seal_entry(forged, body, tenant, method="pqo4"), tokens=S)
        with pytest.warns(StoreWarning, match=why):
            got = run(store, model, victim)
        assert store.last_report.reused == 0 and np.array_equal(got, want) and store.last_report.stored == [S]
        open_entry(backend.get(forged.key), forged, store._tenant)  # replaced: the victim's own entry, tagged


def test_forty_payload_bit_flips_with_the_checksum_recomputed_are_refused_with_a_secret(model, backend):
    store = PrefixStore(backend, chunk_tokens=S, secret=SECRET)
    ids = store_prompt(S + 20)
    want = no_store(model, ids)
    run(store, model, ids)
    key = keys(store, model, ids)[0]
    good = bytes(backend.get(key))
    start = body_offset(good)
    rng = np.random.default_rng(1)
    positions = rng.integers(start + 20, len(good) - _DIGEST, 40)  # the cache file's header and arrays
    used = 0
    for pos in positions:
        body = bytearray(good[start:])
        body[pos - start] ^= 1 << int(rng.integers(8))
        backend.put(key, good[:start] + with_trailer(body), tokens=S)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run(store, model, ids)
        used += store.last_report.reused > 0
        assert np.array_equal(got, want)
        assert any("wrong tag" in str(w.message) for w in caught)
    assert used == 0


def test_without_a_secret_the_binding_still_refuses_edited_headers(model, backend):
    """Unkeyed: a flip in the entry's key, namespace, length or token digest is caught (the payload
    is not protected against a writer who recomputes its checksum: docs/store.md)."""
    store = PrefixStore(backend, chunk_tokens=S)
    ids = store_prompt(S + 20)
    want = no_store(model, ids)
    run(store, model, ids)
    key = keys(store, model, ids)[0]
    good = bytes(backend.get(key))
    header = read_header(good)
    text = good[20 : body_offset(good) - 32]
    for field in ("key", "namespace", "token_digest", "tokens"):
        value = str(header[field]).encode()
        at = text.index(b'"' + field.encode() + b'": ') + len(field) + 4 + (field != "tokens")
        assert text[at : at + len(value)] == value
        edited = bytearray(good)
        edited[20 + at] = ord("7") if edited[20 + at] != ord("7") else ord("3")
        backend.put(key, bytes(edited), tokens=S)
        with pytest.warns(StoreWarning, match="is the entry of"):
            got = run(store, model, ids)
        assert store.last_report.reused == 0 and np.array_equal(got, want)


def test_tenants_share_no_key_and_never_use_each_others_entries(model, backend):
    ids = store_prompt(3 * S + 5)
    a = PrefixStore(backend, chunk_tokens=S, secret=SECRET, policy="every")
    b = PrefixStore(backend, chunk_tokens=S, secret=OTHER)
    plain = PrefixStore(backend, chunk_tokens=S)
    ka, kb, kp = keys(a, model, ids), keys(b, model, ids), keys(plain, model, ids)
    assert len(ka) == 3 and not (set(ka) & set(kb) or set(ka) & set(kp) or set(kb) & set(kp))
    want = no_store(model, ids)
    run(a, model, ids)
    assert a.last_report.stored == [S, 2 * S, 3 * S]
    cache = model.make_cache("pqo4")
    assert b.longest(model, cache, ids) == 0 and plain.longest(model, cache, ids) == 0  # no probing across
    for j in range(3):  # a writer copies tenant A's entries under B's keys
        backend.put(kb[j], bytes(backend.get(ka[j])), tokens=(j + 1) * S)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(b, model, ids)
    assert b.last_report.reused == 0 and np.array_equal(got, want)
    assert sum("wrong tag" in str(w.message) for w in caught) == 3
    assert b.last_report.stored == [S, 2 * S, 3 * S]  # every refused entry replaced (policy "last" or not)
    assert np.array_equal(run_quietly(b, model, ids), want) and b.last_report.reused == 3 * S
    # A's entries are still A's, and an unkeyed reader cannot use them under its own keys either
    assert np.array_equal(run_quietly(a, model, ids), want) and a.last_report.reused == 3 * S
    backend.put(kp[0], bytes(backend.get(ka[0])), tokens=S)
    short = ids[: S + 3]
    with pytest.warns(StoreWarning, match="another key"):
        got = run(plain, model, short)
    assert plain.last_report.reused == 0 and np.array_equal(got, no_store(model, short))


def test_an_entry_header_names_no_prompt_with_a_secret(model, backend):
    """What a reader of the store sees of a keyed entry (key, namespace, token digest) is not the
    public digests an attacker could compute from a guessed prompt."""
    ids = store_prompt(S + 20)
    keyed, plain = PrefixStore(backend, chunk_tokens=S, secret=SECRET), PrefixStore(backend, chunk_tokens=S)
    run(keyed, model, ids)
    run(plain, model, ids)
    hk = read_header(bytes(backend.get(keys(keyed, model, ids)[0])))
    hp = read_header(bytes(backend.get(keys(plain, model, ids)[0])))
    assert hk["tag"] == "hmac-sha256" and hp["tag"] is None
    for field in ("key", "namespace", "token_digest"):
        assert hk[field] != hp[field]
    assert hp["token_digest"] == Tenant(None).tokens(ids[:S])  # public: anyone can test a guess
    assert hk["token_digest"] == Tenant(SECRET).tokens(ids[:S])


def test_the_secret_comes_from_the_environment_and_is_checked(model, tmp_path, monkeypatch):
    ids = store_prompt(2 * S)
    given = keys(PrefixStore(tmp_path, chunk_tokens=S, secret=SECRET), model, ids)
    monkeypatch.setenv(SECRET_ENV, SECRET.decode())
    from_env = PrefixStore(tmp_path, chunk_tokens=S)
    assert from_env.keyed and keys(from_env, model, ids) == given
    assert "tenant" not in repr(from_env)  # the secret is never shown
    monkeypatch.setenv(SECRET_ENV, "")
    assert not PrefixStore(tmp_path, chunk_tokens=S).keyed
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=SECRET_ENV):
        PrefixStore(tmp_path)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match="secret must hold at least 16 bytes"):
        PrefixStore(tmp_path, secret=b"0123456789")
    with pytest.raises(TypeError, match="secret"):
        PrefixStore(tmp_path, secret=12345678901234567890)
    with pytest.raises(TypeError, match="keys must be"):
        PrefixStore(tmp_path, chunk_tokens=S).prefill_segments(lambda seg: None, ids, model.make_cache("pqo4"), [])


def test_a_refused_entry_is_replaced_whatever_the_policy_stores(model, tmp_path):
    """policy="last" stores only the longest boundary, but a refused shorter entry is rewritten."""
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S)
    ids = store_prompt(2 * S + 5)
    k1 = keys(store, model, ids)[0]
    store.backend.put(k1, b"damaged", tokens=S)
    with pytest.warns(StoreWarning):
        got = run(store, model, ids)
    assert store.last_report.stored == [S, 2 * S] and np.array_equal(got, no_store(model, ids))
    short = ids[: S + 7]
    assert np.array_equal(run_quietly(store, model, short), no_store(model, short))
    assert store.last_report.reused == S
    none = PrefixStore(store.backend, chunk_tokens=S, policy="none")  # a reader only: writes nothing
    store.backend.put(k1, b"damaged", tokens=S)
    with pytest.warns(StoreWarning):
        run(none, model, short)
    assert none.last_report.stored == []
    with open(store.backend.path_of(k1), "rb") as f:
        assert f.read() == b"damaged"


def test_an_entry_counts_as_used_only_once_it_was_accepted(model, tmp_path):
    """Eviction orders by use: a refused entry must not look used, an accepted one must."""
    backend = LocalStore(tmp_path)
    store = PrefixStore(backend, chunk_tokens=S, policy="every")
    ids = store_prompt(2 * S + 5)
    run(store, model, ids)
    k1, k2 = keys(store, model, ids)
    backend.put(k2, b"damaged", tokens=2 * S)
    old = time.time() - 3600
    for k in (k1, k2):
        os.utime(backend.path_of(k), (old, old))
    reader = PrefixStore(backend, chunk_tokens=S, policy="none")
    with pytest.warns(StoreWarning):
        run(reader, model, ids)
    assert reader.last_report.reused == S
    used = {e.key: e.last_used for e in backend.entries()}
    assert used[k1] > time.time() - 60  # restored: marked as used
    assert used[k2] < time.time() - 3000  # refused: not


def test_model_identity_covers_every_weight(model, tmp_path):
    """A model that differs from another in 64 weights no sample of 4,096 values per tensor would
    read gets another identity, so it never restores the other's entries."""
    other = store_model()
    lw = other.layers[1]
    wgu = np.array(lw.wgu)  # 64 x 192: a sampler of 4,096 values per tensor reads every third
    flat = wgu.reshape(-1)
    flat[np.arange(64) * 3 + 1] += 0.5
    other.layers[1] = dataclasses.replace(lw, wgu=wgu)
    assert model_identity(other) != model_identity(model)
    assert model_identity(store_model()) == model_identity(model)  # the same weights, another object
    ids = store_prompt(S + 20)
    store = PrefixStore(tmp_path, chunk_tokens=S)
    run(store, model, ids)
    assert set(keys(store, other, ids)).isdisjoint(keys(store, model, ids))
    got = run(store, other, ids)
    assert store.last_report.reused == 0 and np.array_equal(got, no_store(other, ids))
    assert not np.array_equal(got, no_store(model, ids))


def test_model_identity_refuses_to_guess(model):
    class NotLayers:
        wq = np.zeros(3)

    with pytest.raises(TypeError, match="model_id"):
        model_identity(object())
    odd = store_model()
    odd.layers = [NotLayers()]
    with pytest.raises(TypeError, match="model_id"):
        model_identity(odd)


def test_onnx_identity_covers_every_weight_inline_and_external(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((250, 400)).astype(np.float32)

    def graph(weights):
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        g = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 250])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 400])],
            [numpy_helper.from_array(weights, "w")],
        )
        return helper.make_model(g)

    changed = w.copy()
    changed.reshape(-1)[1:129:2] += 1.0  # 64 values between those of a 4,096-word sample (every 24th)
    base = onnx_identity(graph(w))
    assert onnx_identity(graph(changed)) != base
    for name, weights in (("a", w), ("b", changed)):
        path = str(tmp_path / f"{name}.onnx")
        onnx.save_model(graph(weights), path, save_as_external_data=True, location=f"{name}.bin")
    ext = {n: onnx.load(str(tmp_path / f"{n}.onnx"), load_external_data=False) for n in "ab"}
    assert onnx_identity(ext["a"], str(tmp_path)) == base  # external data named as the model loaded whole
    assert onnx_identity(ext["b"], str(tmp_path)) != base
    # an engine's identity reads the external data on first use, and only if it is still the file read
    later = onnx_identity_later(ext["b"], str(tmp_path))
    assert later() == onnx_identity(ext["b"], str(tmp_path))
    stale = onnx_identity_later(ext["a"], str(tmp_path))
    (tmp_path / "a.bin").write_bytes((tmp_path / "b.bin").read_bytes() + b"\0")  # another size: changed
    with pytest.raises(ValueError, match="changed since the model was read"):
        stale()


def test_an_onnx_files_identity_covers_its_external_data(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import helper, numpy_helper

    from arraykv.integrations.onnxruntime.prefix_store import graph_identity

    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "m.onnx"
    onnx.save_model(helper.make_model(g), str(path), save_as_external_data=True, location="w.bin", size_threshold=0)
    before = graph_identity(str(path))()
    copy = tmp_path / "copy"  # the same graph file beside data that differs in one weight's bit
    copy.mkdir()
    (copy / "m.onnx").write_bytes(path.read_bytes())
    data = bytearray((tmp_path / "w.bin").read_bytes())
    data[100] ^= 1
    (copy / "w.bin").write_bytes(bytes(data))
    assert graph_identity(str(copy / "m.onnx"))() != before
    assert graph_identity(str(path))() == before


def test_transformers_identity_covers_every_weight_and_in_place_changes():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from arraykv.integrations.transformers.prefix_store import transformers_identity

    m = hf_llama(0)
    base = transformers_identity(m)
    assert transformers_identity(hf_llama(0)) == base
    name, t = max(m.state_dict().items(), key=lambda kv: kv[1].numel())
    step = max(1, t.numel() // 4096)
    assert step > 1, f"{name} has {t.numel()} values: a sampler would read them all"
    with torch.no_grad():
        t.reshape(-1)[1 : 64 * step : step] += 1.0  # between the values a 4,096-value sample reads
    assert transformers_identity(m) != base


def test_entries_are_listed_with_their_tokens(model, tmp_path):
    store = PrefixStore(LocalStore(tmp_path), chunk_tokens=S, secret=SECRET, policy="every")
    run(store, model, store_prompt(2 * S + 1))
    assert sorted(e.tokens for e in store.backend.entries()) == [S, 2 * S]


@pytest.mark.slow
def test_smollm2_another_prompts_entry_is_never_used(tmp_path):
    """On the real model, keyed and not: the entry of another 64-token prompt under a victim's key."""
    from arraykv import eval as ev

    from smollm import smollm_or_skip

    model = smollm_or_skip()
    text = ev.builtin_token_ids(model, 300)
    victim, other = text[:100], text[150:250]
    for secret in (None, SECRET):
        store = PrefixStore(LocalStore(tmp_path / str(secret is None)), chunk_tokens=64, secret=secret)
        store.prefill(model, other, model.make_cache("pqo4"), chunk_size=64)
        kv = store.keys(model, model.make_cache("pqo4"), victim, chunk_size=64)[0]
        ko = store.keys(model, model.make_cache("pqo4"), other, chunk_size=64)[0]
        store.backend.put(kv, bytes(store.backend.get(ko)), tokens=64)
        want = segmented_prefill(model, victim, model.make_cache("pqo4"), chunk_tokens=64, chunk_size=64)
        with pytest.warns(StoreWarning, match="another key"):
            got = store.prefill(model, victim, model.make_cache("pqo4"), chunk_size=64)
        assert store.last_report.reused == 0 and np.array_equal(got, want)
        warm = store.prefill(model, victim, model.make_cache("pqo4"), chunk_size=64)
        assert store.last_report.reused == 64 and np.array_equal(warm, want)
