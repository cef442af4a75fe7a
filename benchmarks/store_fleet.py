"""A fleet sharing a prefix store: worker processes answering questions after a few system prompts.

Each of ``--workers`` processes loads SmolLM2-135M (the own decoder) and answers
``--requests`` prompts: one of ``--systems`` system prompts (``--system-tokens`` tokens of the
shipped novel, each from another place in it) followed by a question of ``--question-tokens``
tokens, the system prompts taken in turn. Every worker runs the same requests against each
store, all workers at once (a barrier starts each store's round), in this order:

- ``none``: no store (the prompt prefilled as ``generate`` does without one);
- ``folder``: one :class:`LocalStore` folder shared by the workers;
- ``valkey``: one Valkey server on 127.0.0.1;
- ``cluster``: a three-primary Valkey Cluster on 127.0.0.1 (:class:`ValkeyCluster`).

Columns: hit rate (requests whose system prompt was restored from the store), time to first
token (the prefill of the whole prompt up to the logits of its last position: median and mean
over all workers' requests), its ratio to ``none``'s median, and whether every store-backed
result equals the same schedule without a store bit for bit (checked on the first request of
each system prompt in each worker). The first request of a system prompt misses (and stores
it) in the worker that runs it first; workers that ask for it at the same moment miss too.

Run::

    OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/store_fleet.py

(One thread per process: the workers share the machine's cores.)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

STORES = ("none", "folder", "valkey", "cluster")


def _requests(model, args) -> list:
    """``(system index, ids)`` of every request a worker runs (the same in every worker)."""
    from arraykv import eval as ev

    text = ev.builtin_long_token_ids(model, args.systems * args.system_tokens + 4096)
    systems = [text[i * args.system_tokens : (i + 1) * args.system_tokens] for i in range(args.systems)]
    rng = np.random.default_rng(0)
    questions = text[args.systems * args.system_tokens :]
    out = []
    for r in range(args.requests):
        s = r % args.systems
        start = int(rng.integers(0, len(questions) - args.question_tokens))
        out.append((s, systems[s] + questions[start : start + args.question_tokens]))
    return out


def _worker(rank: int, args, specs: dict, barrier, results) -> None:
    import warnings

    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.store import PrefixStore, segmented_prefill

    model = load_model(args.model, quiet=True)
    requests = _requests(model, args)
    # rank-specific order: workers start on different system prompts, as a fleet would
    requests = requests[rank:] + requests[:rank]
    S = args.chunk_tokens
    # warm-up: compile every kernel of the timed paths (a throwaway folder store)
    with tempfile.TemporaryDirectory() as tmp:
        warm = PrefixStore(tmp, chunk_tokens=S)
        for _ in range(2):
            warm.prefill(model, requests[0][1], model.make_cache(args.method), chunk_size=S)
        model.prefill(requests[0][1], model.make_cache(args.method), chunk_size=S, logits="last")
    for name in STORES:
        spec = specs.get(name)
        if name != "none" and spec is None:
            continue
        store = None if spec is None else PrefixStore(spec, chunk_tokens=S)
        barrier.wait()
        rows, checked = [], set()
        for s, ids in requests:
            cache = model.make_cache(args.method)
            t0 = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if store is None:
                    logits = model.prefill(ids, cache, chunk_size=S, logits="last")
                else:
                    logits = store.prefill(model, ids, cache, chunk_size=S)
            took = time.perf_counter() - t0
            hit = store is not None and store.last_report.reused > 0
            same = None
            if store is not None and s not in checked:
                checked.add(s)
                ref = segmented_prefill(model, ids, model.make_cache(args.method), chunk_tokens=S, chunk_size=S)
                same = bool(np.array_equal(ref, logits))
            rows.append((took, hit, same, len(caught)))
        results.put((name, rank, rows))
    barrier.wait()


def main(argv=None) -> int:
    from arraykv.store.server import ValkeyCluster, ValkeyServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12, help="requests per worker")
    ap.add_argument("--systems", type=int, default=3, help="distinct system prompts")
    ap.add_argument("--system-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--chunk-tokens", type=int, default=256, help="the store's segment, also the prefill chunk")
    ap.add_argument("--method", default="pqo4")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    print("# store fleet, SmolLM2-135M; command: " + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    print(
        f"# {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cpus, numpy {np.__version__}, "
        f"python {platform.python_version()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
        f"NUMBA_NUM_THREADS={os.environ.get('NUMBA_NUM_THREADS', 'unset')}"
    )
    print(
        f"# {args.workers} workers x {args.requests} requests; {args.systems} system prompts of "
        f"{args.system_tokens} tokens + questions of {args.question_tokens}; {args.method}, "
        f"segments of {args.chunk_tokens}"
    )
    ctx = mp.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="arraykv-fleet-") as folder,
        ValkeyServer() as server,
        ValkeyCluster(3) as cluster,
    ):
        specs = {"folder": os.path.join(folder, "store"), "valkey": server.url, "cluster": cluster.url}
        barrier = ctx.Barrier(args.workers)
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, args, specs, barrier, results)) for r in range(args.workers)]
        for p in procs:
            p.start()
        got: dict = {name: [] for name in STORES}
        for _ in range(args.workers * len(STORES)):
            name, _rank, rows = results.get(timeout=3600)
            got[name] += rows
        for p in procs:
            p.join(timeout=120)
    base = statistics.median(t for t, *_ in got["none"])
    print()
    print("| store | requests | hit rate | TTFT median s | TTFT mean s | median / none | same | warnings |")
    print("|---|---|---|---|---|---|---|---|")
    for name in STORES:
        rows = got[name]
        times = [t for t, *_ in rows]
        hits = sum(h for _, h, _, _ in rows)
        checks = [s for _, _, s, _ in rows if s is not None]
        same = "-" if not checks else ("yes" if all(checks) else f"NO ({checks.count(False)} of {len(checks)})")
        print(
            f"| {name} | {len(rows)} | {hits / len(rows):.0%} | {statistics.median(times):.3f} | "
            f"{statistics.mean(times):.3f} | {statistics.median(times) / base:.2f} | {same} | "
            f"{sum(w for *_, w in rows)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
