"""A prompt's cache computed once and reused: the prefill schedule, the lookup and the storing policy.

What "continue" means
---------------------
With a store, a prompt of ``n`` tokens is prefilled in **segments** of ``chunk_tokens`` tokens
(the last one shorter), each segment one call of the decoder's own chunked prefill::

    for s in range(0, n, chunk_tokens):
        model.prefill(ids[s:s + chunk_tokens], cache, chunk_size=chunk_size, prompt_store=prompt_store)

(:func:`segmented_prefill`). The cache after the first ``j`` segments depends only on the
namespace (model, cache configuration, this schedule) and on those ``j · chunk_tokens`` ids, and
that is what the entry of key ``h_j`` holds (:mod:`arraykv.store.keys`). Restoring it and
running the remaining segments makes the same calls on the same state as running every
segment, so the logits, every stored array and everything decoded after are **bit for bit
those of** :func:`segmented_prefill` **without a store** -- whatever the store holds, whichever
prefix is found, and whichever process or machine of the same array library wrote it (tested
on the logits and on every array the cache holds). One part of a cache is not stored: the
float16 rollback copies of its latest encoded tokens (:func:`~arraykv.store.encode_cache` with
``rollback_copies=False``), which serve only ``truncate`` and take no part in attention. A
restored cache holds the copies of the tokens it encodes itself, the last of those a fresh run
holds (all of them once it has encoded ``rollback_tokens``), and cannot be truncated back into
the stored prefix's encoded tokens. On SmolLM2 ``pqo4`` the copies are 0.37 MB of a 2k-token
entry (30 layers x 16 tokens).

Segments are what make that hold. The decoder's default ``prompt_store="exact"`` keeps a
prompt's keys and values exact while its chunks run and compresses them, calibrating on the
whole prompt, at its end (:mod:`arraykv.integrations.common.prompt_stage`). A state in the middle of
such a prompt is not a compressed cache, and a cache restored there and continued would
calibrate on, and attend to, other things than one run in a piece: the two differ. So the
exact staging spans one segment: within a segment the prompt is computed exactly, and each
segment is stored compressed at its end. A segment of ``chunk_tokens <= chunk_size`` tokens is
one chunk, stored as it comes. The quality then lies between ``prompt_store="chunks"`` and
``"exact"`` over the whole prompt: larger ``chunk_tokens`` keep more of it exact and find
prefixes at a coarser grain.

Lookup
------
The longest stored prefix that leaves at least one token to prefill (the logits of the
prompt's last position come from that prefill): keys from the longest boundary below ``n``
down to ``chunk_tokens``, the first entry found and accepted is restored. An entry that is
refused (corrupted, crafted, of another configuration) is skipped with a warning.

Storing policy
--------------
``policy="last"`` (default): the prompt's longest whole-chunk prefix, unless stored already
(so a conversation stores each turn's prompt, at its last boundary, and the next turn finds
it); ``"every"``: every whole-chunk prefix not stored yet (more reuse between prompts that
share only a beginning, more bytes and time: each entry is the whole cache up to it);
``"none"``: look up only. Generated tokens are not stored (the next turn's prompt, which
includes them, is). An entry is written right after its segment, before the next segment runs.

Failures of the store itself (server down, disk full) do not fail generation: with
``on_error="warn"`` (default) they are warnings and the prompt is computed; ``"raise"``
raises them.
"""

from __future__ import annotations

import functools
import operator
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from .._compat import namespace as _namespace
from ..protocol import KV_CACHE, supports
from ..storage.cache_file import FORMAT_VERSION
from .backend import EntryError, StoreBackend, StoreError, guarded
from .binding import Binding, Tenant, open_entry, seal_entry, secret_from
from .entry import encode_cache, restore_entry
from .keys import chain_digests, model_identity, namespace_root

__all__ = [
    "PrefixStore",
    "PrefixKeys",
    "PrefillReport",
    "StoreWarning",
    "segmented_prefill",
    "open_backend",
    "POLICIES",
]

_T = TypeVar("_T")

#: The storing policies (module docstring).
POLICIES = ("last", "every", "none")


class StoreWarning(UserWarning):
    """The store failed or refused an entry; the prompt was computed instead."""


class PrefixKeys(list):
    """The keys of a prompt's whole-chunk prefixes (a list of str, shortest first) and their namespace.

    Parameters
    ----------
    keys : iterable of str
        Entry ``j - 1`` names the first ``j · chunk_tokens`` ids.
    namespace : str
        The namespace the entries of these keys name (hex; the store's tenant derives it).
    """

    def __init__(self, keys: Any, namespace: str):
        super().__init__(keys)
        self.namespace = namespace


@dataclass
class PrefillReport:
    """What one :meth:`PrefixStore.prefill` did.

    Parameters
    ----------
    tokens : int
        Prompt tokens.
    reused : int
        Tokens restored from the store (0: none found).
    computed : int
        Tokens prefilled.
    stored : list of int
        Prefix lengths written to the store.
    restore_s, prefill_s, store_s : float
        Seconds spent restoring, prefilling and storing.
    """

    tokens: int = 0
    reused: int = 0
    computed: int = 0
    stored: list = field(default_factory=list)
    restore_s: float = 0.0
    prefill_s: float = 0.0
    store_s: float = 0.0


def open_backend(spec: Any) -> StoreBackend:
    """A backend from ``spec``.

    Parameters
    ----------
    spec : StoreBackend, str or path-like
        A backend object (any object with callable ``get``, ``put``, ``contains``, ``delete``,
        ``entries`` and ``evict``), a ``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``,
        ``unix://`` or cluster (``redis+cluster://host:port,host:port``, ``valkey+cluster://``)
        URL, or a folder.

    Returns
    -------
    StoreBackend
        ``spec`` itself for a backend object, a :class:`~arraykv.store.valkey.ValkeyStore` for
        a URL, a :class:`~arraykv.store.local.LocalStore` for a folder.

    Raises
    ------
    TypeError
        ``spec`` is none of these.
    """
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if text.startswith(
            ("redis://", "rediss://", "valkey://", "valkeys://", "unix://", "redis+cluster://", "valkey+cluster://")
        ):
            from .valkey import ValkeyStore

            return ValkeyStore(text.replace("valkey", "redis", 1) if text.startswith("valkey") else text)
        from .local import LocalStore

        return LocalStore(text)
    if all(callable(getattr(spec, m, None)) for m in ("get", "put", "contains", "delete", "entries", "evict")):
        return cast(StoreBackend, spec)
    raise TypeError(
        f"a store backend must offer get/put/contains/delete/entries/evict, or be a folder or a "
        f"redis:// URL; received {type(spec).__name__}"
    )


def _segments(start: int, n: int, chunk_tokens: int) -> list:
    return [(s, min(s + chunk_tokens, n)) for s in range(start, n, chunk_tokens)]


def segmented_prefill(
    model: Any,
    ids: Any,
    cache: Any,
    *,
    chunk_tokens: int = 512,
    chunk_size: int | None = 512,
    prompt_store: str = "exact",
) -> Any:
    """The store's prefill schedule without a store: what every store-backed prefill equals.

    Parameters
    ----------
    model : DecoderModel
        The model that prefills (:class:`~arraykv.integrations.decoder.model.DecoderModel`).
    ids : sequence of int
        The prompt (one sequence).
    cache : CompressedKVCache
        Empty or holding a whole number of segments of the same schedule.
    chunk_tokens : int, default 512
        Tokens per segment, as :class:`PrefixStore`'s ``chunk_tokens``.
    chunk_size : int or None, default 512
        The decoder's prefill chunk within each segment (:meth:`DecoderModel.prefill`).
    prompt_store : {"exact", "chunks"}, default "exact"
        The decoder's staging within each segment (:meth:`DecoderModel.prefill`).

    Returns
    -------
    array, shape (vocab,), float32
        Logits of the prompt's last position.
    """
    ids = _ids(ids)
    start = _length(cache)
    if start % chunk_tokens:
        raise ValueError(f"the cache holds {start} tokens, not a whole number of {chunk_tokens}-token segments")
    out = None
    for s, e in _segments(start, len(ids), chunk_tokens):
        out = model.prefill(ids[s:e], cache, chunk_size=chunk_size, logits="last", prompt_store=prompt_store)
    if out is None:
        raise ValueError("the cache already holds the whole prompt: nothing to prefill")
    return out


class PrefixStore:
    """Stored prefixes of prompts, for one or many models and cache configurations.

    Parameters
    ----------
    backend : StoreBackend, str or path-like
        Where entries live: a :class:`~arraykv.store.local.LocalStore`, a
        :class:`~arraykv.store.valkey.ValkeyStore`, any object of the
        :class:`~arraykv.store.backend.StoreBackend` interface, a folder, or a ``redis://`` URL.
    chunk_tokens : int, default 512
        Tokens per chunk of the key chain and per prefill segment (module docstring).
    policy : {"last", "every", "none"}, default "last"
        Which prefixes are stored.
    model_id : str, optional
        The model's identity; default :func:`~arraykv.store.keys.model_identity` of the model.
    on_error : {"warn", "raise"}, default "warn"
        What a failing backend or a refused entry does.
    secret : bytes or str, optional
        The tenant's secret (at least 16 bytes; text is taken as its UTF-8 bytes); default the
        environment variable ``ARRAYKV_STORE_SECRET`` when set and not empty. With a secret,
        keys are derived with it (``HMAC(secret, h_j)``: stores of other secrets share no key,
        and nothing of a key or an entry's header tells a reader without the secret which
        prompt it holds) and every entry carries an HMAC-SHA256 tag over its key, namespace and
        bytes; an entry with no tag or a wrong one is refused and recomputed. Without one, an
        entry is still bound to its key, namespace and token ids (:mod:`~arraykv.store.binding`),
        but whoever can write the store can forge that binding (``docs/store.md``).

    Attributes
    ----------
    backend : StoreBackend
    last_report : PrefillReport or None
        What the last :meth:`prefill` did (of the last call in any thread).
    """

    def __init__(
        self,
        backend: Any,
        *,
        chunk_tokens: int = 512,
        policy: str = "last",
        model_id: str | None = None,
        on_error: str = "warn",
        secret: bytes | str | None = None,
    ):
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive integer, received {chunk_tokens!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, received {policy!r}")
        if on_error not in ("warn", "raise"):
            raise ValueError(f"on_error must be 'warn' or 'raise', received {on_error!r}")
        if model_id is not None and (not isinstance(model_id, str) or not model_id):
            raise ValueError(f"model_id must be a non-empty string or None, received {model_id!r}")
        self._tenant = Tenant(secret_from(secret))
        self.backend = guarded(open_backend(backend))  # every failure a StoreError; a circuit breaker
        self.chunk_tokens, self.policy, self.model_id, self.on_error = chunk_tokens, policy, model_id, on_error
        self.last_report: PrefillReport | None = None

    def __repr__(self) -> str:
        return (
            f"PrefixStore({self.backend!r}, chunk_tokens={self.chunk_tokens}, policy={self.policy!r}, "
            f"keyed={self.keyed})"
        )

    @property
    def keyed(self) -> bool:
        """Whether the store has a secret (derived keys, tagged entries)."""
        return self._tenant.keyed

    # -- keys ---------------------------------------------------------------------------
    def keys(
        self, model: Any, cache: Any, ids: Any, *, chunk_size: int | None = 512, prompt_store: str = "exact"
    ) -> PrefixKeys:
        """Keys of ``ids``'s whole-chunk prefixes for this model, cache configuration and schedule
        (:func:`~arraykv.store.keys.chain_keys`: entry ``j - 1`` names the first ``j · chunk_tokens``).

        Parameters
        ----------
        model : DecoderModel
            The model; named by :attr:`model_id` when set, else by
            :func:`~arraykv.store.keys.model_identity`.
        cache : LayeredCache or HybridCache
            A cache of the configuration the entries hold (its ``get_config()`` is hashed).
        ids : sequence of int
            The prompt (one sequence).
        chunk_size : int or None, default 512
            The decoder's prefill chunk within each segment, as given to :meth:`prefill`.
        prompt_store : {"exact", "chunks"}, default "exact"
            The decoder's staging within each segment, as given to :meth:`prefill`.

        Returns
        -------
        PrefixKeys
            ``len(ids) // chunk_tokens`` keys, shortest prefix first: entry ``j - 1`` names the
            first ``j * chunk_tokens`` ids.
        """
        model_id = self.model_id if self.model_id is not None else model_identity(model)
        sample = getattr(model, "embedding", None)
        lib = _namespace(sample).__name__ if sample is not None else "unknown"
        schedule = {"chunk_size": chunk_size, "prompt_store": prompt_store, "array_library": lib}
        return self.engine_keys(model_id, cache, ids, schedule)

    def engine_keys(self, model_id: str, cache: Any, ids: Any, schedule: dict) -> PrefixKeys:
        """Keys of ``ids``'s whole-chunk prefixes for any engine: ``model_id`` names the model,
        ``schedule`` (JSON-able) how the engine fills a segment; the chunk size, arraykv's
        version and the file format are added to it.

        Parameters
        ----------
        model_id : str
            The model's identity (non-empty); :attr:`model_id` replaces it when set.
        cache : LayeredCache or HybridCache
            A cache of the configuration the entries hold (its ``get_config()`` is hashed).
        ids : sequence of int
            The prompt (one sequence).
        schedule : dict
            How the engine fills a segment (JSON-serializable); entries made under another
            schedule are not found.

        Returns
        -------
        PrefixKeys
            ``len(ids) // chunk_tokens`` keys, shortest prefix first: entry ``j - 1`` names the
            first ``j * chunk_tokens`` ids (the chain digests, or with a secret their HMACs).
        """
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id must be a non-empty string, received {model_id!r}")
        if self.model_id is not None:
            model_id = self.model_id
        schedule = {
            "chunk_tokens": self.chunk_tokens,
            **schedule,
            "arraykv": _arraykv_version(),
            "format": FORMAT_VERSION,
        }
        root = namespace_root(model_id, cache.get_config(), schedule)
        digests = chain_digests(root, _ids(ids), self.chunk_tokens)
        return PrefixKeys((self._tenant.key(d) for d in digests), self._tenant.namespace(root))

    def longest(self, model: Any, cache: Any, ids: Any, **schedule: Any) -> int:
        """Tokens of the longest stored prefix of ``ids`` that :meth:`prefill` could reuse (0 if none).

        Only looks keys up (``contains``); the entry may still be refused when it is read.

        Parameters
        ----------
        model : DecoderModel
            The model, as given to :meth:`prefill`.
        cache : LayeredCache or HybridCache
            A cache of the configuration the entries hold.
        ids : sequence of int
            The prompt (one sequence).
        **schedule
            ``chunk_size`` and ``prompt_store``, as given to :meth:`prefill` (forwarded to
            :meth:`keys`).

        Returns
        -------
        int
            A multiple of :attr:`chunk_tokens` below ``len(ids)``, or 0.
        """
        ids = _ids(ids)
        keys = self.keys(model, cache, ids, **schedule)
        for j in range(min(len(keys), (len(ids) - 1) // self.chunk_tokens), 0, -1):
            if self._try(functools.partial(self.backend.contains, keys[j - 1]), False):
                return j * self.chunk_tokens
        return 0

    # -- the prefill --------------------------------------------------------------------
    def prefill(
        self, model: Any, ids: Any, cache: Any, *, chunk_size: int | None = 512, prompt_store: str = "exact"
    ) -> Any:
        """Prefill ``ids`` into the empty ``cache``, reusing the longest stored prefix; store by the policy.

        Parameters
        ----------
        model : DecoderModel
            The model that prefills (:class:`~arraykv.integrations.decoder.model.DecoderModel`).
        ids : sequence of int
            The prompt (one sequence).
        cache : LayeredCache or HybridCache
            Empty; an arraykv cache (its ``get_config``, ``snapshot`` and ``restore`` are used).
        chunk_size : int or None, default 512
            The decoder's prefill chunk within each segment.
        prompt_store : {"exact", "chunks"}, default "exact"
            The decoder's staging within each segment.

        Returns
        -------
        array, shape (vocab,), float32
            Logits of the prompt's last position, bit for bit those of :func:`segmented_prefill`.
        """
        keys = self.keys(model, cache, ids, chunk_size=chunk_size, prompt_store=prompt_store)
        return self.prefill_segments(
            lambda seg: model.prefill(seg, cache, chunk_size=chunk_size, logits="last", prompt_store=prompt_store),
            ids,
            cache,
            keys,
        )

    def prefill_segments(self, run: Any, ids: Any, cache: Any, keys: PrefixKeys) -> Any:
        """The store's prefill for any engine: restore the longest stored prefix of ``ids`` into the
        empty ``cache``, then ``run(segment)`` for each remaining segment, storing by the policy.

        Parameters
        ----------
        run : callable
            ``run(list of int)`` prefills one segment after what ``cache`` holds, storing its K/V
            there, and returns the logits of its last position.
        ids : sequence of int
            The prompt (one sequence).
        cache : LayeredCache or HybridCache
            Empty; the cache ``run`` fills.
        keys : PrefixKeys
            :meth:`keys` (this package's decoder) or :meth:`engine_keys` (another engine) of
            ``ids``, or of its first tokens.

        Returns
        -------
        object
            What the last ``run`` returned (the logits of the prompt's last position).
        """
        ids = _ids(ids)
        if _length(cache) != 0:
            raise ValueError("cache must be empty; call cache.reset() first")
        namespace = getattr(keys, "namespace", None)
        if not isinstance(namespace, str) or not isinstance(keys, list) or len(keys) > len(ids) // self.chunk_tokens:
            raise TypeError("keys must be what this store's keys() or engine_keys() returned for ids")
        n, S = len(ids), self.chunk_tokens
        report = PrefillReport(tokens=n)
        try:
            t0 = time.perf_counter()
            start, refused = self._restore(cache, keys, ids, min(len(keys), (n - 1) // S))
            report.restore_s = time.perf_counter() - t0
            report.reused, report.computed = start, n - start
            # a refused entry is replaced by the one computed now, whatever the policy would store
            wanted = self._wanted(len(keys), start // S) | (refused if self.policy != "none" else set())
            out = None
            for s, e in _segments(start, n, S):
                t0 = time.perf_counter()
                out = run(ids[s:e])
                t1 = time.perf_counter()
                report.prefill_s += t1 - t0
                j = e // S
                if e % S == 0 and j in wanted and self._put(self._binding(keys, ids, j), cache, replace=j in refused):
                    report.stored.append(e)
                report.store_s += time.perf_counter() - t1
        except BaseException:
            cache.reset()  # the cache came empty: a prefill that fails anywhere leaves it so
            raise
        self.last_report = report
        return out

    def _wanted(self, boundaries: int, restored: int) -> set:
        """Chunk counts whose prefixes the policy stores (beyond the ``restored`` one)."""
        if self.policy == "none" or boundaries <= restored:
            return set()
        if self.policy == "last":
            return {boundaries}
        return set(range(restored + 1, boundaries + 1))

    def _binding(self, keys: PrefixKeys, ids: list, j: int) -> Binding:
        """What the entry of the first ``j`` chunks of ``ids`` is: its key, namespace and tokens."""
        tokens = j * self.chunk_tokens
        return Binding(keys[j - 1], keys.namespace, tokens, self._tenant.tokens(ids[:tokens]))

    def _restore(self, cache: Any, keys: PrefixKeys, ids: list, top: int) -> tuple[int, set]:
        """Restore the longest acceptable entry among the first ``top`` keys.

        Returns its tokens (0 if none) and the chunk counts whose entries were refused (to be
        replaced). An entry is marked as used (``touch``) only once it was accepted.
        """
        refused = set()
        for j in range(top, 0, -1):
            want = self._binding(keys, ids, j)
            what = f"the stored {want.tokens}-token prefix {want.key[:16]}..."
            try:
                data = self._try(functools.partial(self.backend.get, want.key), None, refusals=False)
                if data is None:
                    continue
                restore_entry(cache, open_entry(data, want, self._tenant, what=what), tokens=want.tokens, what=what)
            except EntryError as exc:
                if self.on_error == "raise":
                    raise
                warnings.warn(f"{exc}; computing it instead", StoreWarning, stacklevel=4)
                refused.add(j)
                continue
            touch = getattr(self.backend, "touch", None)
            if callable(touch):
                self._try(functools.partial(touch, want.key), None)
            return want.tokens, refused
        return 0, refused

    def _put(self, binding: Binding, cache: Any, *, replace: bool = False) -> bool:
        """Store the cache as the entry of ``binding`` unless one is held (or ``replace``: it was refused)."""
        if not replace and self._try(lambda: self.backend.contains(binding.key), True):
            return False

        def put() -> bool:
            body = encode_cache(cache, rollback_copies=False)
            method = cache.get_config().get("method")
            data = seal_entry(binding, body, self._tenant, method=method if isinstance(method, str) else None)
            del body
            self.backend.put(binding.key, data, tokens=binding.tokens)
            return True

        return self._try(put, False)

    def _try(self, fn: Callable[[], _T], fallback: _T, *, refusals: bool = True) -> _T:
        """``fn()``; a failure of the store is a warning and ``fallback`` (or raised, per ``on_error``).

        ``refusals=False`` lets an :class:`EntryError` (an entry refused) through to the caller.
        """
        errors: tuple = (StoreError, EntryError) if refusals else (StoreError,)
        try:
            return fn()
        except errors as exc:
            if self.on_error == "raise":
                raise
            warnings.warn(f"prefix store: {exc}", StoreWarning, stacklevel=4)
            return fallback


def as_prefix_store(store: Any) -> PrefixStore:
    """``store`` if it is a :class:`PrefixStore`, else one with default settings over it (:func:`open_backend`)."""
    return store if isinstance(store, PrefixStore) else PrefixStore(store)


def _ids(ids: Any) -> list:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"ids must be a sequence of token ids, received {type(ids).__name__}")
    if len(ids) == 0:
        raise ValueError("ids must hold at least one token")
    try:
        if any(isinstance(i, bool) for i in ids):
            raise TypeError
        return [operator.index(i) for i in ids]
    except TypeError:
        raise TypeError("ids must be integers (one sequence of token ids)") from None


@functools.cache
def _arraykv_version() -> str:
    """The installed arraykv's version (read from its metadata: this layer does not import the package root)."""
    from importlib import metadata

    try:
        return metadata.version("arraykv")
    except metadata.PackageNotFoundError:
        return "unknown"


def _length(cache: Any) -> int:
    if not supports(cache, KV_CACHE):
        raise TypeError(f"cache must be a CompressedKVCache, received {type(cache).__name__}")
    return int(cache.seq_len(0))
