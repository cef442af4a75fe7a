"""Compressed prefix store: a prompt's cache computed once, reused by any process or machine.

- :class:`PrefixStore` (:mod:`.prefix`): keys, lookup of the longest stored prefix, the prefill
  schedule that makes a continued cache equal a fresh one bit for bit, and the storing policy;
  ``model.generate(prompt, store=...)`` uses it.
- Backends (:mod:`.backend` for the interface): :class:`LocalStore` (a folder, no server) and
  :class:`ValkeyStore` (a Valkey/Redis server; :class:`ValkeyServer` starts one on 127.0.0.1).
- Entries are cache files (:mod:`.entry`): the checked, versioned format of :func:`arraykv.load`.

See ``docs/store.md``.
"""

from .backend import DEFAULT_MAX_ENTRY_BYTES, EntryError, EntryInfo, StoreBackend, StoreError
from .entry import encode_cache, restore_entry
from .keys import chain_keys, gguf_identity, model_identity
from .local import LocalStore
from .prefix import POLICIES, PrefillReport, PrefixStore, StoreWarning, open_backend, segmented_prefill
from .server import ValkeyServer
from .valkey import ValkeyStore

__all__ = [
    "PrefixStore",
    "PrefillReport",
    "StoreWarning",
    "POLICIES",
    "segmented_prefill",
    "open_backend",
    "StoreBackend",
    "EntryInfo",
    "StoreError",
    "EntryError",
    "DEFAULT_MAX_ENTRY_BYTES",
    "LocalStore",
    "ValkeyStore",
    "ValkeyServer",
    "encode_cache",
    "restore_entry",
    "model_identity",
    "gguf_identity",
    "chain_keys",
]
