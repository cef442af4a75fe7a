"""What ties a stored entry to the prompt it was asked for: the entry's envelope, its tag, the tenant's keys.

An entry is a cache file (:mod:`arraykv.store.entry`) inside an envelope that names what it is
the cache of::

    magic    8 bytes   b"AKVENTRY"
    version  4 bytes   little-endian uint32 (1)
    hlen     8 bytes   little-endian uint64, length of the header (at most HEADER_MAX)
    header   hlen      UTF-8 JSON: {"key", "namespace", "tokens", "token_digest", "method",
                       "tag", "body"}
    tag      32 bytes  HMAC-SHA256 of everything before it and of the body (zeros: no tag)
    body     "body"    the cache file

``key`` is the entry's own key, ``namespace`` the digest of the model, cache configuration and
schedule it was computed under, ``token_digest`` the digest of the token ids it holds and
``tokens`` their count; ``tag`` is ``"hmac-sha256"`` for an entry written with a secret, else
null. A reader (:func:`open_entry`) refuses an entry whose own key, namespace, tokens or token
digest are not the ones it asked for, so an entry copied under another key is never restored.

The prefix and header come first and are small (bounded by :data:`HEADER_MAX`): a reader learns
the binding, whether there is a tag and the tag itself before the body, refuses a foreign or
untagged entry from those bytes alone, and checks the tag in one pass over bytes it reads once
(the HMAC is fed the header and then the body as they are, no copy). Nothing of the body is
decoded before the tag is checked (:func:`hmac.compare_digest`, constant time).

A :class:`Tenant` holds a store's secret, or none. With a secret every derived name is keyed:
the entry keys (``HMAC(secret, "key" || h_j)`` of the public chain digest ``h_j``), the
namespace and token digests written into entries, and the tag; without one they are the public
SHA-256 digests. So two tenants with different secrets share no key, and one cannot tell from
the store (its keys, its entries' headers) which prompts another has stored. See
``docs/store.md`` ("Who can change what a prompt computes") for what each mode protects.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backend import EntryError

__all__ = [
    "Binding",
    "Tenant",
    "seal_entry",
    "open_entry",
    "read_header",
    "ENTRY_MAGIC",
    "HEADER_MAX",
    "SECRET_ENV",
    "MIN_SECRET_BYTES",
    "secret_from",
]

ENTRY_MAGIC = b"AKVENTRY"
ENTRY_VERSION = 1
#: Longest envelope header a reader parses (a header is about 400 bytes).
HEADER_MAX = 1 << 16
#: The environment variable :class:`~arraykv.store.PrefixStore` reads its secret from.
SECRET_ENV = "ARRAYKV_STORE_SECRET"
#: Shortest secret accepted (128 bits).
MIN_SECRET_BYTES = 16
_PREFIX = len(ENTRY_MAGIC) + 12
_TAG = 32
_NO_TAG = bytes(_TAG)
#: The binding's fields, each with what an entry that differs in it is the entry of.
_FIELDS = {
    "key": "another key",
    "namespace": "another namespace (model, cache configuration or schedule, or store secret)",
    "tokens": "a prefix of another length",
    "token_digest": "another prompt",
}


@dataclass(frozen=True)
class Binding:
    """What an entry is the cache of: the facts a reader checks against what it asked for.

    Parameters
    ----------
    key : str
        The entry's key (hexadecimal).
    namespace : str
        The tenant's digest of the namespace root (hexadecimal, :meth:`Tenant.namespace`).
    tokens : int
        Tokens of the prefix.
    token_digest : str
        The tenant's digest of the prefix's token ids (hexadecimal, :meth:`Tenant.tokens`).
    """

    key: str
    namespace: str
    tokens: int
    token_digest: str


class Tenant:
    """A store's secret (or none) and every name derived from it.

    Parameters
    ----------
    secret : bytes or None
        At least :data:`MIN_SECRET_BYTES` bytes; None for an unkeyed store (public digests, no tag).
    """

    def __init__(self, secret: bytes | None):
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES):
            raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes or None")
        self._secret = secret

    def __repr__(self) -> str:
        return f"Tenant(keyed={self.keyed})"  # never the secret

    @property
    def keyed(self) -> bool:
        """Whether the tenant has a secret (keys, digests and tags are HMACs)."""
        return self._secret is not None

    def _digest(self, label: bytes, *parts: Any) -> bytes:
        if self._secret is None:
            h: Any = hashlib.sha256()
        else:
            h = hmac.new(self._secret, b"arraykv/" + label + b"\x00", hashlib.sha256)
        for p in parts:
            h.update(p)
        out: bytes = h.digest()
        return out

    def key(self, chain_digest: bytes) -> str:
        """The entry key (hex) of a prefix whose public chain digest is ``chain_digest``.

        Parameters
        ----------
        chain_digest : bytes
            ``h_j`` of :func:`~arraykv.store.keys.chain_digests` (32 bytes).

        Returns
        -------
        str
            ``h_j`` in hex without a secret; ``HMAC-SHA256(secret, "arraykv/key" || h_j)`` in hex with one.
        """
        return chain_digest.hex() if self._secret is None else self._digest(b"key", chain_digest).hex()

    def namespace(self, root: bytes) -> str:
        """The namespace an entry names (hex): ``root`` itself without a secret, its HMAC with one.

        Parameters
        ----------
        root : bytes
            ``h_0`` (:func:`~arraykv.store.keys.namespace_root`).

        Returns
        -------
        str
            64 hexadecimal digits.
        """
        return root.hex() if self._secret is None else self._digest(b"namespace", root).hex()

    def tokens(self, ids: Any) -> str:
        """The digest (hex) of token ids, as little-endian int64: SHA-256, or its HMAC with a secret.

        Parameters
        ----------
        ids : sequence of int
            The prefix's token ids.

        Returns
        -------
        str
            64 hexadecimal digits.
        """
        return self._digest(b"tokens", np.asarray(ids, dtype="<i8").reshape(-1).tobytes()).hex()

    def tag(self, head: Any, body: Any) -> bytes:
        """The tag of an entry: HMAC-SHA256 over its prefix and header (``head``), then its body.

        Parameters
        ----------
        head, body : bytes-like
            The entry's bytes before the tag, and after it.

        Returns
        -------
        bytes
            32 bytes; zeros for an unkeyed tenant (no tag).
        """
        if self._secret is None:
            return _NO_TAG
        return self._digest(b"entry", head, body)


def seal_entry(
    binding: Binding, body: bytes | bytearray | memoryview, tenant: Tenant, *, method: str | None = None
) -> bytes:
    """The store entry of a cache file ``body``: the envelope naming ``binding``, tagged by ``tenant``.

    Parameters
    ----------
    binding : Binding
        What the body is the cache of.
    body : bytes-like
        The cache file (:func:`~arraykv.store.entry.encode_cache`).
    tenant : Tenant
        Tags the entry when it holds a secret.
    method : str, optional
        The cache's method, for listings.

    Returns
    -------
    bytes
        Prefix, header, tag and body.
    """
    header = {
        "key": binding.key,
        "namespace": binding.namespace,
        "tokens": int(binding.tokens),
        "token_digest": binding.token_digest,
        "method": method,
        "tag": "hmac-sha256" if tenant.keyed else None,
        "body": len(body),
    }
    text = json.dumps(header, sort_keys=True).encode("utf-8")
    head = ENTRY_MAGIC + struct.pack("<IQ", ENTRY_VERSION, len(text)) + text
    return b"".join((head, tenant.tag(head, body), body))


def read_header(head: Any) -> dict | None:
    """The envelope header of an entry from its first bytes, or None when they do not start one.

    Parameters
    ----------
    head : bytes-like
        The entry's first bytes (its 20-byte prefix and header at least).

    Returns
    -------
    dict or None
        The header's fields (unchecked: for listings and for :func:`open_entry`'s checks).
    """
    view = memoryview(head)
    if len(view) < _PREFIX or bytes(view[: len(ENTRY_MAGIC)]) != ENTRY_MAGIC:
        return None
    version, hlen = struct.unpack_from("<IQ", view, len(ENTRY_MAGIC))
    if version != ENTRY_VERSION or hlen > HEADER_MAX or _PREFIX + hlen > len(view):
        return None
    try:
        header = json.loads(bytes(view[_PREFIX : _PREFIX + hlen]).decode("utf-8"))
    except (ValueError, RecursionError):
        return None
    return header if isinstance(header, dict) else None


def open_entry(data: Any, want: Binding, tenant: Tenant, *, what: str = "entry") -> memoryview:
    """The cache file inside an entry, once the entry is shown to be the one asked for.

    Parameters
    ----------
    data : bytes-like
        The entry as a backend returned it.
    want : Binding
        What the reader asked for.
    tenant : Tenant
        The reader's: with a secret, the tag must be present and right.
    what : str
        How errors name the entry.

    Returns
    -------
    memoryview
        The body (the cache file), a view of ``data``; nothing of it decoded.

    Raises
    ------
    EntryError
        Not an entry of this format; a header over :data:`HEADER_MAX` or not matching the
        entry's size; with a secret, no tag or a tag that does not match; an entry of another
        key, namespace, prompt or length. Checked in that order, the tag before anything of the
        body is read.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"an entry is bytes, received {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX + _TAG or bytes(view[: len(ENTRY_MAGIC)]) != ENTRY_MAGIC:
        raise EntryError(f"{what} is not a store entry (no entry header)")
    version, hlen = struct.unpack_from("<IQ", view, len(ENTRY_MAGIC))
    if version != ENTRY_VERSION:
        raise EntryError(f"{what} has entry format version {version}; this arraykv reads {ENTRY_VERSION}")
    if hlen > HEADER_MAX or _PREFIX + hlen + _TAG > len(view):
        raise EntryError(f"{what} declares a header of {hlen} bytes (at most {HEADER_MAX}, within the entry)")
    header = read_header(view[: _PREFIX + hlen])
    if header is None:
        raise EntryError(f"{what} has an unreadable entry header")
    start = _PREFIX + hlen + _TAG
    body = view[start:]
    if header.get("body") != len(body) or isinstance(header.get("body"), bool):
        raise EntryError(f"{what} declares a body of {header.get('body')!r} bytes but holds {len(body)}")
    if tenant.keyed:
        if header.get("tag") != "hmac-sha256":
            raise EntryError(f"{what} carries no tag (written without a secret); this store requires one")
        if not hmac.compare_digest(tenant.tag(view[: _PREFIX + hlen], body), bytes(view[_PREFIX + hlen : start])):
            raise EntryError(f"{what} has a wrong tag (written with another secret, or altered)")
    for name, other in _FIELDS.items():
        if header.get(name) != getattr(want, name) or isinstance(header.get(name), bool):
            raise EntryError(f"{what} is the entry of {other}: its {name} is not the one asked for")
    return body


def secret_from(secret: Any) -> bytes | None:
    """The secret a store uses: ``secret``, else the environment's :data:`SECRET_ENV`, else None.

    Parameters
    ----------
    secret : bytes, str or None
        Bytes (at least :data:`MIN_SECRET_BYTES`), or text (its UTF-8 bytes); None reads
        :data:`SECRET_ENV` (unset or empty: no secret).

    Returns
    -------
    bytes or None
    """
    source = "secret"
    if secret is None:
        text = os.environ.get(SECRET_ENV, "")
        if not text:
            return None
        secret, source = text, SECRET_ENV
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, (bytes, bytearray, memoryview)):
        raise TypeError(f"secret must be bytes, str or None, received {type(secret).__name__}")
    out = bytes(secret)
    if len(out) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} must hold at least {MIN_SECRET_BYTES} bytes, received {len(out)}")
    return out
