"""Prefix store on SmolLM2-135M: time to first token with and without a stored prefix, bytes, throughput.

Time to first token (TTFT): a prompt of ``L`` tokens of the shipped novel plus a ``--suffix``
of new tokens (a question after a stored document). Columns, all measured in this run:

- ``plain``: ``model.prefill`` of the whole prompt as ``generate`` runs it without a store
  (chunks of 512, the prompt exact until its end);
- ``cold``: the store's schedule with nothing stored (``--chunk-tokens`` segments), storing
  the prefix in the local folder (the store's write included; its part in brackets);
- ``local`` / ``valkey``: the same prompt again, its ``L``-token prefix restored from the local
  folder / from a Valkey server on 127.0.0.1, then the suffix prefilled (median of
  ``--repeats``);
- ``speed-up``: ``plain`` / warm, the gain of a stored prefix over prefilling it;
- ``same``: whether the warm runs' logits equal the cold run's bit for bit.

Bytes per stored prefix against float16 keys and values of the same tokens, and store/load
throughput per method (``--bytes-length`` tokens): encode (the cache to entry bytes), put and
get of each backend, restore (bytes to a cache); GB/s are float16-equivalent bytes per second.

``--quality``: instead, what the store's segments cost in quality: a ``--quality-prefix``-token
prefix, then ``--quality-positions`` teacher-forced positions decoded through the cache; KL and
top-1 agreement against a dense cache, for the prompt in one piece (no store) and for each
``--quality-chunks`` segment length.

Run::

    OPENBLAS_NUM_THREADS=1 nice -n 10 python benchmarks/prefix_store.py --lengths 2048 4096 8192

(On a 2-core machine shared with other work, OpenBLAS's second thread spin-waits for a core and
makes the small matrix products of a short prefill 20-40x slower; one thread per process is
the setting that measures the code rather than the contention.)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np


def _spec(text: str) -> tuple:
    """``"pqo4:max_outliers=2,seed=1"`` as ``("pqo4", {"max_outliers": 2, "seed": 1})``."""
    import json

    name, _, rest = text.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        try:
            options[k] = json.loads(v)
        except ValueError:
            options[k] = v
    return name, options


def _median_time(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> int:
    from arraykv import eval as ev
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.store import LocalStore, PrefixStore, ValkeyServer, ValkeyStore, encode_cache, restore_entry

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096, 8192], help="stored prefix lengths")
    ap.add_argument("--method", default="pqo4", help="cache method of the TTFT table (NAME[:OPTION=VALUE,...])")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["pqo4", "pqo4:max_outliers=2", "int4", "dense"],
        help="methods of the bytes/throughput table (NAME[:OPTION=VALUE,...])",
    )
    ap.add_argument("--bytes-length", type=int, default=2048, help="prefix tokens of the bytes/throughput table")
    ap.add_argument("--suffix", type=int, default=16, help="new prompt tokens after the stored prefix")
    ap.add_argument("--chunk-tokens", type=int, default=512, help="the store's segment (chunk) length")
    ap.add_argument("--repeats", type=int, default=2, help="warm runs per store (median)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quality", action="store_true", help="measure the segments' quality cost instead")
    ap.add_argument("--quality-methods", nargs="+", default=["pqo4", "pqo2"])
    ap.add_argument("--quality-prefix", type=int, default=3840)
    ap.add_argument("--quality-positions", type=int, default=128)
    ap.add_argument("--quality-chunks", nargs="+", type=int, default=[512, 1280])
    args = ap.parse_args(argv)
    if args.quality:
        return quality(args)

    model = load_model(args.model, quiet=True)
    ttft_name, ttft_options = _spec(args.method)

    def ttft_cache():
        return model.make_cache(ttft_name, **ttft_options)

    c = model.config
    f16_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    longest = max(args.lengths + [args.bytes_length]) + args.suffix
    all_ids = ev.builtin_long_token_ids(model, longest)
    print("# prefix store, SmolLM2-135M; command: " + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    print(
        f"# {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cpus, numpy {np.__version__}, "
        f"python {platform.python_version()}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    with tempfile.TemporaryDirectory(prefix="arraykv-bench-store-") as folder, ValkeyServer() as server:
        print(f"# local stores under {folder}; Valkey {server.binary} on 127.0.0.1:{server.port}")
        print()
        warm_up = PrefixStore(LocalStore(os.path.join(folder, "warm-up")), chunk_tokens=args.chunk_tokens)
        for _ in range(2):  # compiles every kernel of the paths timed below, outside the timings
            warm_up.prefill(model, all_ids[: args.chunk_tokens + args.suffix], ttft_cache())
        print(
            f"## time to first token, {args.method}, prefix + {args.suffix} new tokens, segments of {args.chunk_tokens}"
        )
        print()
        print(
            "| prefix tokens (segments) | plain s | cold s (store part) | local s (restore part) | "
            "valkey s (restore part) | "
            "speed-up local | speed-up valkey | entry MB | float16 MB | float16 / entry | same |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row, L in enumerate(args.lengths):
            # the prompt fits the context: an 8192-token prefix becomes 16 segments of 511 tokens
            L = min(L, c.context_length - args.suffix)
            segments = max(1, round(L / args.chunk_tokens))
            seg = L // segments
            L = seg * segments
            ids = all_ids[: L + args.suffix]
            local = LocalStore(os.path.join(folder, f"row{row}"))  # nothing stored by an earlier row
            valkey = ValkeyStore(server.url, prefix=f"row{row}:")
            t0 = time.perf_counter()
            model.prefill(ids, ttft_cache(), chunk_size=512, logits="last")
            plain = time.perf_counter() - t0
            ps_local = PrefixStore(local, chunk_tokens=seg, policy="last")
            ps_valkey = PrefixStore(valkey, chunk_tokens=seg, policy="last")
            t0 = time.perf_counter()
            cold_logits = ps_local.prefill(model, ids, ttft_cache())
            cold = time.perf_counter() - t0
            store_part = ps_local.last_report.store_s
            key = ps_local.keys(model, ttft_cache(), ids)[segments - 1]
            entry = local.get(key)
            valkey.put(key, entry, tokens=L)  # the same entry on the server
            same = True
            warm, restore = {}, {}
            for name, ps in (("local", ps_local), ("valkey", ps_valkey)):
                secs, logits = _median_time(lambda: ps.prefill(model, ids, ttft_cache()), args.repeats)
                assert ps.last_report.reused == L, (name, ps.last_report)
                warm[name], restore[name] = secs, ps.last_report.restore_s
                same &= bool(np.array_equal(logits, cold_logits))
            f16 = L * f16_per_token
            print(
                f"| {L} ({segments} x {seg}) | {plain:.2f} | {cold:.2f} ({store_part:.2f}) | "
                f"{warm['local']:.2f} ({restore['local']:.2f}) | "
                f"{warm['valkey']:.2f} ({restore['valkey']:.2f}) | "
                f"{plain / warm['local']:.1f}x | {plain / warm['valkey']:.1f}x | {len(entry) / 1e6:.1f} | "
                f"{f16 / 1e6:.1f} | {f16 / len(entry):.2f} | {'yes' if same else 'NO'} |",
                flush=True,
            )

        L = args.bytes_length
        ids = all_ids[:L]
        local = LocalStore(os.path.join(folder, "bytes"))
        valkey = ValkeyStore(server.url, prefix="bytes:")
        f16 = L * f16_per_token
        print()
        print(
            f"## bytes and throughput per method, {L}-token prefix (float16: {f16 / 1e6:.1f} MB); "
            "GB/s of float16-equivalent bytes"
        )
        print()
        print(
            "| method | entry MB | float16 / entry | encode GB/s | local put GB/s | local get GB/s | valkey put GB/s | "
            "valkey get GB/s | restore GB/s |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for method in args.methods:
            name, options = _spec(method)
            cache = model.make_cache(name, **options)
            model.prefill(ids, cache, chunk_size=512, logits="last")
            t_enc, data = _median_time(lambda: encode_cache(cache, rollback_copies=False), args.repeats)
            key = f"{abs(hash(method)):032x}"[-32:]
            t_lput, _ = _median_time(lambda: local.put(key, data, tokens=L), args.repeats)
            t_lget, got = _median_time(lambda: local.get(key), args.repeats)
            assert got == data
            t_vput, _ = _median_time(lambda: valkey.put(key, data, tokens=L), args.repeats)
            t_vget, got = _median_time(lambda: valkey.get(key), args.repeats)
            assert got == data

            def restore():
                target = model.make_cache(name, **options)
                restore_entry(target, data, tokens=L)
                return target

            t_res, _ = _median_time(restore, args.repeats)
            gb = f16 / 1e9
            print(
                f"| {method} | {len(data) / 1e6:.2f} | {f16 / len(data):.2f} | {gb / t_enc:.2f} | {gb / t_lput:.2f} | "
                f"{gb / t_lget:.2f} | {gb / t_vput:.2f} | {gb / t_vget:.2f} | {gb / t_res:.2f} |",
                flush=True,
            )
            local.delete(key)
            valkey.delete(key)
    return 0


def quality(args) -> int:
    """KL and top-1 agreement against dense after a prefix prefilled in one piece or in segments."""
    from arraykv import eval as ev
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.store import segmented_prefill

    model = load_model(args.model, quiet=True)
    P, N = args.quality_prefix, args.quality_positions
    ids = ev.builtin_long_token_ids(model, P + N)

    def run(method: str, chunk_tokens: int | None) -> np.ndarray:
        cache = model.make_cache(method)
        if chunk_tokens is None:
            model.prefill(ids[:P], cache, chunk_size=512, logits="last")
        else:
            segmented_prefill(model, ids[:P], cache, chunk_tokens=chunk_tokens, chunk_size=512)
        return np.stack([np.asarray(model.decode(t, cache), dtype=np.float64) for t in ids[P : P + N]])

    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    print("# prefix store quality, SmolLM2-135M; command: " + " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]))
    print(
        f"# {P}-token prefix, {N} teacher-forced positions; KL and top-1 against a dense cache; "
        f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}"
    )
    print()
    print("| cache | prefill | KL | top-1 |")
    print("|---|---|---|---|")
    ref = log_softmax(run("dense", None))
    for method in args.quality_methods:
        for chunk_tokens in [None, *args.quality_chunks]:
            lq = log_softmax(run(method, chunk_tokens))
            kl = float((np.exp(ref) * (ref - lq)).sum(axis=-1).mean())
            top1 = float((ref.argmax(-1) == lq.argmax(-1)).mean())
            how = "one piece (no store)" if chunk_tokens is None else f"store, chunk_tokens={chunk_tokens}"
            print(f"| {method} | {how} | {kl:.4f} | {100 * top1:.1f} % |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
