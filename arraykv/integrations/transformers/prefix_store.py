"""A prefix store for :class:`~arraykv.integrations.transformers.cache.ArraykvCache`: generate from a stored prompt.

transformers' ``generate`` runs the uncached part of a prompt in one forward, and a compressed
cache's state after one call differs from its state after the same tokens in several calls, so
a prefix restored from a store would not continue as a run without one. :func:`generate_with_store`
runs the prompt itself, in the store's segments (:meth:`~arraykv.store.PrefixStore.prefill_segments`),
one ``model(input_ids=segment, cache=cache)`` forward per segment, restoring the longest stored
prefix first and storing by the store's policy, then hands ``model.generate`` the whole prompt
with the cache holding all of it but its last token: ``generate`` runs that token and decodes.

What "continue" means. For one prompt, model, cache configuration and store settings, the
tokens returned and every array of ``cache.arraykv_cache`` after the call are those of the same
call finding no entry (a cold run), whichever stored prefix was restored; the one exception is
the float16 rollback copies, which entries leave out: a restored cache holds the last of the
copies the cold run holds (:mod:`arraykv.store.prefix`). The forwards are the same in both
runs: segments of ``chunk_tokens`` from the prompt's start, the last one stopping before the
prompt's last token, then ``generate``'s.

Model identity. The key namespace names the model by :func:`transformers_identity` (its
configuration and every byte of every parameter and buffer, see there) unless the store carries a
``model_id``, and names the engine and its schedule: ``"transformers"``, whether the cache
receives the model's queries (``hooked``) and attends fused, the model's attention
implementation and dtype, and the torch and transformers versions.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from typing import Any

__all__ = ["generate_with_store", "transformers_identity"]

_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def transformers_identity(model: Any) -> str:
    """A hex digest naming a transformers model's configuration and every byte of its weights, for store keys.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model (``config`` and ``state_dict()``).

    Returns
    -------
    str
        ``"transformers:"`` and the SHA-256, hex, of the configuration's JSON (``config.to_dict()``
        without its private ``_``-keys and ``transformers_version``, keys sorted) and, for every
        tensor of ``state_dict()`` in its order, its name, shape, dtype and all its bytes. Two
        models that differ in any value differ. The digest is remembered per model object
        together with each tensor's storage and version counter, so it is computed once per
        model (SmolLM2-135M: about 0.7 s) and again only after a weight was replaced or changed
        in place.
    """
    import torch

    config = getattr(model, "config", None)
    if (
        config is None
        or not callable(getattr(config, "to_dict", None))
        or not callable(getattr(model, "state_dict", None))
    ):
        raise TypeError(
            f"model must be a transformers model (config, state_dict), received {type(model).__name__}; "
            "pass PrefixStore(..., model_id=...) to name it"
        )
    cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    text = json.dumps(cfg, sort_keys=True, default=str)
    tensors = model.state_dict()
    # what would make the digest stale: another config, a tensor replaced, resized or written in place
    stamp = (text, tuple((n, t.data_ptr(), t._version, tuple(t.shape), str(t.dtype)) for n, t in tensors.items()))
    with _LOCK:
        known = _IDENTITIES.get(model)
        if known is not None and known[0] == stamp:
            return str(known[1])
        h = hashlib.sha256(text.encode())
        with torch.no_grad():
            for name, t in tensors.items():
                shape = tuple(int(s) for s in t.shape)
                h.update(f"{name}:{shape}:{t.dtype}".encode())
                flat = t.detach().reshape(-1).contiguous().cpu()
                h.update(flat.view(torch.uint8).numpy())
        digest = "transformers:" + h.hexdigest()
        try:
            _IDENTITIES[model] = (stamp, digest)
        except TypeError:
            pass
    return digest


def generate_with_store(model: Any, input_ids: Any, cache: Any, store: Any, **generate_kwargs: Any) -> Any:
    """``model.generate(input_ids, cache=cache, ...)`` with the prompt's longest stored prefix reused.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A decoder-only causal LM on the CPU.
    input_ids : torch.Tensor, shape (1, n), int64
        The prompt: one sequence (batch 1), no padding.
    cache : ArraykvCache
        Empty, ``incremental=False``, built for ``model`` (its queries hooked or not, fused or not:
        the key namespace tells these apart).
    store : PrefixStore, folder or ``redis://`` URL
        Where prefixes are looked up and stored; segments of its ``chunk_tokens``.
    **generate_kwargs
        Passed to ``model.generate`` (``max_new_tokens``, ``do_sample``, ...); not ``cache``,
        ``past_key_values`` or an ``attention_mask`` that hides a token.

    Returns
    -------
    torch.Tensor, shape (1, n + new), int64
        What ``model.generate`` returns (the prompt and the new tokens).

    Raises
    ------
    TypeError
        ``cache`` is not an ArraykvCache, or ``input_ids`` not an integer tensor.
    ValueError
        A batch of more than one sequence, an empty prompt, a cache that holds tokens, an
        ``incremental=True`` cache (its float pasts are not in the entries), or a cache or
        attention mask passed in ``generate_kwargs``.

    Notes
    -----
    ``store.last_report`` tells what was reused, computed and stored. A prompt of one token has
    nothing to store or reuse and goes straight to ``generate``.
    """
    import torch
    import transformers

    from ...store.prefix import as_prefix_store
    from .cache import ArraykvCache

    if not isinstance(cache, ArraykvCache):
        raise TypeError(f"cache must be an ArraykvCache, received {type(cache).__name__}")
    if cache.incremental:
        raise ValueError(
            "an incremental=True ArraykvCache keeps float pasts that store entries do not hold; "
            "build the cache with incremental=False to use a store"
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.dim() != 2:
        raise TypeError("input_ids must be an integer torch.Tensor of shape (1, n)")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"a store serves one sequence at a time (batch 1); received a batch of {int(input_ids.shape[0])}"
        )
    n = int(input_ids.shape[1])
    if n == 0:
        raise ValueError("input_ids must hold at least one token")
    if cache.get_seq_length() != 0:
        raise ValueError("cache must be empty; call cache.reset() first")
    for name in ("cache", "past_key_values"):
        if name in generate_kwargs:
            raise ValueError(f"{name} is the cache argument of generate_with_store, not a generate keyword")
    mask = generate_kwargs.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError("an attention_mask that hides tokens (padding) cannot be used with a store")

    if n > 1:
        ps = as_prefix_store(store)
        ids = input_ids[0].tolist()
        model_id = ps.model_id if ps.model_id is not None else transformers_identity(model)
        schedule = {
            "engine": "transformers",
            "chunk_size": None,
            "array_library": "numpy",
            "hooked": int(cache.hooked_layers),
            "fused": bool(cache.fused),
            "attn_implementation": str(getattr(model.config, "_attn_implementation", None)),
            "dtype": str(getattr(model, "dtype", None)),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        # keys name the whole-chunk prefixes of the first n - 1 tokens: the last one is generate's
        keys = ps.engine_keys(model_id, cache.arraykv_cache, ids[: n - 1], schedule)
        device = input_ids.device

        def run(seg: list) -> Any:
            start = cache.get_seq_length()
            if start + len(seg) == n:  # the prompt's last segment: its last token is generate's
                seg = seg[:-1]
            if not seg:
                return None
            x = torch.tensor([seg], dtype=torch.long, device=device)
            positions = torch.arange(start, start + len(seg), device=device)[None]
            with torch.no_grad():
                out = model(input_ids=x, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
            return out.logits[0, -1]

        ps.prefill_segments(run, ids, cache.arraykv_cache, keys)
    with torch.no_grad():
        return model.generate(input_ids, cache=cache, **generate_kwargs)
