"""A separate process for the multi-process store tests: ``python store_worker.py COMMAND ...``.

Commands (BACKEND is a folder or a redis:// URL, PREFIX the server key prefix):

``hammer BACKEND PREFIX SEED OPS SIZE``
    OPS random puts and gets of self-checking payloads on four keys; prints ``reads torn``
    (exit status 1 when a read returned bytes that are not a whole payload).
``writeloop BACKEND PREFIX SIZE``
    Writes entries of SIZE bytes until killed (prints ``started`` first).
``prefix BACKEND PREFIX METHOD N CHUNK_TOKENS OUT``
    Prefills N tokens of the tiny model through a PrefixStore; saves the last logits and the
    report's reused tokens to OUT (.npz).
"""

from __future__ import annotations

import hashlib
import os
import random
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the tests' tiny models

KEYS = [f"{i:02x}" * 16 for i in range(4)]


def payload(seed: int, size: int) -> bytes:
    """The cache file magic number (what a folder store checks first), the body's SHA-256, the body."""
    body = hashlib.shake_128(f"{seed}".encode()).digest(size)
    return b"ARRAYKV\x00" + hashlib.sha256(body).digest() + body


def backend(spec: str, prefix: str):
    from arraykv.store import LocalStore, ValkeyStore

    if spec.startswith("redis://"):
        return ValkeyStore(spec, prefix=prefix)
    return LocalStore(spec)


def main(argv: list) -> int:
    cmd, spec, prefix = argv[0], argv[1], argv[2]
    store = backend(spec, prefix)
    if cmd == "hammer":
        seed, ops, size = int(argv[3]), int(argv[4]), int(argv[5])
        rng = random.Random(seed)
        reads = torn = 0
        for i in range(ops):
            key = rng.choice(KEYS)
            if rng.random() < 0.5:
                store.put(key, payload(seed * 100_000 + i, size + rng.randrange(size)))
            else:
                data = store.get(key)
                if data is not None:
                    reads += 1
                    torn += hashlib.sha256(data[40:]).digest() != data[8:40]
        print(reads, torn, flush=True)
        return 1 if torn else 0
    if cmd == "writeloop":
        size = int(argv[3])
        print("started", flush=True)
        i = 0
        while True:
            store.put(KEYS[i % 4], payload(i, size))
            i += 1
    if cmd == "prefix":
        from arraykv.store import PrefixStore

        from tiny_models import store_model, store_prompt

        method, n, chunk_tokens, out = argv[3], int(argv[4]), int(argv[5]), argv[6]
        model = store_model()
        ids = store_prompt(n)
        ps = PrefixStore(store, chunk_tokens=chunk_tokens)
        logits = ps.prefill(model, ids, model.make_cache(method), chunk_size=32)
        np.savez(out, logits=np.asarray(logits), reused=ps.last_report.reused)
        return 0
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
