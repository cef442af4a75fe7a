"""SmolLM2-135M under ONNX Runtime: arraykv's cache inside the graph, the hook, and ORT's own int4/int8 KV.

Engines, all from the same float32 graph (``examples/export_smollm2_onnx.py``):

- ``ORT float`` — the plain ONNX Runtime loop, ``present.*`` fed back as ``past_key_values.*``:
  the reference ("the float cache") every KL is measured against;
- ``in graph, <method>`` — :class:`~arraykv.integrations.onnxruntime.graph_decoder.OrtGraphDecoder`:
  each layer's attention replaced by the ``ArrayKVAttention`` operator over an arraykv cache;
- ``hook, <method>`` — :class:`~arraykv.integrations.onnxruntime.OrtKVDecoder`, the graph as
  exported, the past reconstructed by the cache and fed back every step;
- ``ORT GQA int8 / int4 / float32`` — the graph rewritten with ONNX Runtime's
  ``GroupQueryAttention`` (:mod:`arraykv.integrations.onnxruntime.gqa_rewrite`), its KV cache quantized per
  channel with scales calibrated on another text
  (:func:`~arraykv.integrations.onnxruntime.gqa_rewrite.calibrate_kv_scales`
  over the first ``--calib`` tokens of :func:`arraykv.eval.builtin_text`, or with
  ``--calib-source long-tail`` over ``--calib`` tokens of the long text after the measured ones).

Protocol, per context ``N`` (``--contexts``): the first ``N - D`` tokens of the long built-in
text (*Pride and Prejudice*) go through the engine as a prompt in chunks of 512, then the next
``D = --decode`` tokens are fed one decode step each (teacher forcing). The in-graph decoder
stages the prompt's chunks exactly and stores it compressed at its end, as the NumPy decoder
does (``in graph, <method>``); with ``--prompt-store exact chunks`` the engines
``in graph, <method>, chunks`` are measured beside them, storing each chunk as it comes, the
later chunks attending to the stored form of the earlier ones (how the in-graph decoder stored a
prompt before). The hook and ORT's own loops store each chunk as it comes. Reported: mean KL
(float cache || engine) and top-1 agreement over those ``D`` positions, the bytes of K/V the
engine holds at the end (bits per value: ``bytes * 8 / (2 * layers * kv_heads * N * head_dim)``;
the hook counts the cache and the float past it keeps), and decode tokens/s over the ``D``
steps. Engines run one after another in one process.

Every engine first runs a short prompt and two decode steps (kernel compilation is neither timed
nor counted). Peak memory (``--memory-prompt``, ``--memory-loop``, ``--memory-engines``): each
engine in a child process of its own, reading the graphs written to ``--workdir``: the resident
set before the prompt (after the heap's free pages are given back, see :func:`_trim_heap`), then
the peak resident set (``VmHWM``, reset after the prompt) during a loop of ``--memory-loop``
decode steps after a ``--memory-prompt``-token prompt.

``--split`` adds a table of where a decode step's time goes: the in-graph operator's calls
(:func:`arraykv.integrations.onnxruntime.cache_operator.attend_from_cache`), ``cache.decode`` within them,
and the rest of the graph (the timers cost a few microseconds per call).

Run (2-core machine shared with other work: run it niced, once)::

    nice -n 10 python benchmarks/onnx_graph.py --contexts 512 4096 --decode 64 --no-memory
    nice -n 10 python benchmarks/onnx_graph.py --memory-only

Needs the ``model`` and ``onnx`` extras.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRAPH_METHODS = ["dense", "pqo4", "pqo3", "pqo2", "int4"]
HOOK_METHODS = ["pqo4"]
GQA = {"ORT GQA float32": None, "ORT GQA int8": 8, "ORT GQA int4": 4}
MEMORY_ENGINES = [
    "ORT float",
    "in graph, pqo4",
    "in graph, pqo2",
    "in graph, int4",
    "hook, pqo4",
    "ORT GQA int8",
    "ORT GQA int4",
]
CHUNK = 512
#: The engine decode speeds are divided by, where it was measured in the same run.
SPEED_BASE = "ORT GQA int4"


def export_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_smollm2_onnx", ROOT / "examples" / "export_smollm2_onnx.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def engine_names(args) -> list:
    names = ["ORT float"] + [
        f"in graph, {m}" + ("" if store == "exact" else f", {store}")
        for m in args.graph_methods
        for store in args.prompt_store
    ]
    names += [f"hook, {m}" for m in args.hook_methods] + list(GQA)
    if args.engines:
        unknown = set(args.engines) - set(names)
        if unknown:
            raise SystemExit(f"unknown engines {sorted(unknown)}; known: {names}")
        names = ["ORT float"] + [n for n in names if n in args.engines and n != "ORT float"]
    return names


class Engine:
    """One engine behind a uniform step interface: ``prompt(ids)``, ``step(token)``, ``held_bytes()``."""

    def __init__(self, name: str, paths: dict, geometry: dict):
        from arraykv.integrations.onnxruntime.gqa_rewrite import OrtPastLoop

        self.name = name
        self.geometry = geometry
        if name == "ORT float":
            self.engine = OrtPastLoop(str(paths["float"]))
            self.kind = "past"
        elif name in GQA:
            self.engine = OrtPastLoop(str(paths[name]))
            self.kind = "past"
        elif name.startswith("in graph, "):
            from arraykv.integrations.onnxruntime.graph_decoder import OrtGraphDecoder

            self.engine = OrtGraphDecoder(str(paths["float"]))
            parts = name.split(", ")
            self.method = parts[1]
            self.prompt_store = parts[2] if len(parts) > 2 else "exact"
            self.kind = "graph"
        else:
            from arraykv.integrations.onnxruntime import OrtKVDecoder

            self.engine = OrtKVDecoder(str(paths["float"]))
            self.method = name.split(", ")[1]
            self.kind = "hook"
        self.reset()

    def reset(self) -> None:
        self.state = self.engine.make_cache(getattr(self, "method", "dense"))

    def prompt(self, ids) -> None:
        import numpy as np

        a = np.asarray([ids], dtype=np.int64)
        if self.kind == "graph":
            self.engine.prefill(a, self.state, chunk_size=CHUNK, prompt_store=self.prompt_store, logits="last")
            return
        for s in range(0, a.shape[1], CHUNK):
            if self.kind == "hook":
                self.engine.step(a[:, s : s + CHUNK], self.state)
            else:
                self.engine.prefill(a[:, s : s + CHUNK], self.state)

    def step(self, token: int):
        import numpy as np

        return np.asarray(self.engine.decode([int(token)], self.state), dtype=np.float32).reshape(-1)

    def held_bytes(self) -> int:
        """K/V bytes held now: the cache's stored bytes (plus the float past the hook keeps)."""
        if self.kind == "past":
            return self.state.memory_usage()
        n = int(self.state.used_bytes())
        if self.kind == "hook":
            n += self.engine.held_bytes(self.state)
        return n

    def values(self) -> int:
        g = self.geometry
        return 2 * g["layers"] * g["kv_heads"] * g["head_dim"] * int(self.state.seq_len(0))


def logp(z):
    import numpy as np

    z = np.asarray(z, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def warm_up(eng: Engine, ids: list) -> None:
    """A short prompt and two decode steps, so that compiling kernels is not timed or counted."""
    eng.reset()
    eng.prompt(ids[:16])
    eng.step(ids[16])
    eng.step(ids[17])
    eng.reset()


#: Seconds spent, during the timed decode steps, in the ``ArrayKVAttention`` operator's work
#: (:func:`arraykv.integrations.onnxruntime.cache_operator.attend_from_cache`) and in ``cache.decode`` within it.
SPLIT = {"operator": 0.0, "cache.decode": 0.0, "on": False}


def time_operator() -> None:
    """Time the in-graph operator's calls into :data:`SPLIT` (while ``SPLIT["on"]``)."""
    from arraykv.integrations.onnxruntime import cache_operator

    inner = cache_operator.attend_from_cache

    def timed(slot, *args):
        if not SPLIT["on"]:
            return inner(slot, *args)
        cache = slot.cache
        decode = cache.decode

        def timed_decode(*a, **k):
            t0 = time.perf_counter()
            try:
                return decode(*a, **k)
            finally:
                SPLIT["cache.decode"] += time.perf_counter() - t0

        cache.decode = timed_decode  # an instance attribute, removed after the call
        t0 = time.perf_counter()
        try:
            return inner(slot, *args)
        finally:
            SPLIT["operator"] += time.perf_counter() - t0
            del cache.decode

    cache_operator.attend_from_cache = timed


def quality_run(eng: Engine, ids: list, n: int, d: int) -> dict:
    import numpy as np

    eng.reset()
    eng.prompt(ids[: n - d])
    logits, seconds = [], 0.0
    SPLIT.update(operator=0.0, on=True)
    SPLIT["cache.decode"] = 0.0
    for t in ids[n - d : n]:
        t0 = time.perf_counter()
        logits.append(eng.step(t))
        seconds += time.perf_counter() - t0
    SPLIT["on"] = False
    out = {"logits": np.stack(logits), "tok_s": d / seconds, "bytes": eng.held_bytes(), "values": eng.values()}
    out["split_ms"] = (1e3 * seconds / d, 1e3 * SPLIT["operator"] / d, 1e3 * SPLIT["cache.decode"] / d)
    eng.reset()
    return out


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc ``malloc_trim``), where there is glibc.

    Building a rewritten graph frees a few copies of the weights; left in the heap, later
    allocations (the cache, the prompt's activations) would reuse them without the resident
    set growing, and the loop's memory would go unseen.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def memory_child(args) -> int:
    """``--memory-child NAME``: one engine's resident set before the prompt and its peak during the loop."""
    import numpy as np

    work = Path(args.workdir)
    meta = json.loads((work / "meta.json").read_text())
    ids = np.load(work / "ids.npy").tolist()
    eng = Engine(args.memory_child, {k: work / v for k, v in meta["paths"].items()}, meta["geometry"])

    def status(key):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        return -1

    warm_up(eng, ids)
    _trim_heap()
    before = status("VmRSS")
    eng.prompt(ids[: args.memory_prompt])
    after_prompt = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    t0 = time.perf_counter()
    for t in ids[args.memory_prompt : args.memory_prompt + args.memory_loop]:
        eng.step(t)
    dt = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "before": before,
                "after_prompt": after_prompt,
                "peak_loop": status("VmHWM"),
                "held": eng.held_bytes(),
                "tok_s": args.memory_loop / dt,
            }
        )
    )
    return 0


def prepare(args, model) -> tuple:
    """Write the float graph and the GQA graphs to ``--workdir``; return their paths and the geometry."""
    import numpy as np
    import onnx

    from arraykv import eval as ev
    from arraykv.integrations.onnxruntime.gqa_rewrite import calibrate_kv_scales, rewrite_with_gqa

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    c = model.config
    geometry = {"layers": c.num_layers, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim}
    paths = {"float": "smollm2.onnx"}
    for name in GQA:
        paths[name] = "smollm2_" + name.split()[-1] + ".onnx"
    meta_file = work / "meta.json"
    key = [args.calib, args.calib_source]
    if meta_file.exists() and json.loads(meta_file.read_text()).get("calib") == key:
        print(f"reusing the graphs in {work}")
        return {k: work / v for k, v in paths.items()}, geometry
    t0 = time.perf_counter()
    proto = export_module().build_llama_onnx(model)

    def save(p, name):
        for old in (work / name, work / (name + ".data")):  # onnx appends to an existing data file
            old.unlink(missing_ok=True)
        onnx.save_model(
            p,
            str(work / name),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=name + ".data",
            size_threshold=1024,
        )

    if args.calib_source == "builtin":
        calib = ev.builtin_token_ids(model, args.calib)
    else:  # the long text after every token the measurements use
        start = max(max(args.contexts), args.memory_prompt + args.memory_loop)
        calib = ev.builtin_long_token_ids(model, start + args.calib)[start:]
    for name, bits in GQA.items():  # before the float graph: saving moves a proto's weights out of it
        scales = None if bits is None else calibrate_kv_scales(proto, calib, bits)
        save(rewrite_with_gqa(proto, num_heads=c.num_heads, bits=bits, scales=scales), paths[name])
    save(proto, paths["float"])
    meta_file.write_text(json.dumps({"paths": paths, "geometry": geometry, "calib": key}))
    print(f"wrote the graphs to {work} in {time.perf_counter() - t0:.0f} s")
    del proto
    np.save(work / "ids.npy", np.asarray([0]))
    return {k: work / v for k, v in paths.items()}, geometry


def main(argv=None) -> int:
    import arraykv
    from arraykv.integrations.common.downloads import cache_dir
    from arraykv.integrations.common.optional import require

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--decode", type=int, default=64, help="teacher-forced decode steps per context")
    ap.add_argument("--graph-methods", nargs="+", default=GRAPH_METHODS)
    ap.add_argument("--hook-methods", nargs="+", default=HOOK_METHODS)
    ap.add_argument("--calib", type=int, default=1024, help="calibration tokens of the built-in text (ORT GQA scales)")
    ap.add_argument(
        "--calib-source",
        choices=["builtin", "long-tail"],
        default="builtin",
        help="ORT GQA scales from the built-in text, or from the long text after the measured tokens",
    )
    ap.add_argument("--engines", nargs="+", default=None, help="measure only these (and the float reference)")
    ap.add_argument("--memory-prompt", type=int, default=3840)
    ap.add_argument("--memory-loop", type=int, default=256)
    ap.add_argument(
        "--memory-engines",
        nargs="+",
        default=MEMORY_ENGINES,
        help="engines whose peak memory is measured (each in a process of its own)",
    )
    ap.add_argument(
        "--split",
        action="store_true",
        help="also print where a decode step's time goes: the in-graph operator, cache.decode, the rest",
    )
    ap.add_argument(
        "--prompt-store",
        nargs="+",
        choices=["exact", "chunks"],
        default=["exact"],
        help="how the in-graph engines store the prompt's chunks (OrtGraphDecoder.prefill's prompt_store); "
        "'chunks' engines are named 'in graph, <method>, chunks'",
    )
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="skip the quality and speed tables")
    ap.add_argument("--workdir", default=str(cache_dir() / "onnx_graph_bench"))
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.memory_child:
        return memory_child(args)

    import numpy as np

    ort = require("onnxruntime", "onnx")
    ox_version = importlib.metadata.version("onnxruntime-extensions")  # not imported here: it imports torch
    from arraykv import eval as ev
    from arraykv.integrations.decoder.gguf_loading import load_model

    print(f"command: python benchmarks/onnx_graph.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other work); onnxruntime "
        f"{ort.__version__}, onnxruntime-extensions {ox_version}, arraykv {arraykv.__version__}"
    )
    model = load_model()
    paths, geometry = prepare(args, model)
    ids = ev.builtin_long_token_ids(model, max(max(args.contexts), args.memory_prompt + args.memory_loop))
    np.save(Path(args.workdir) / "ids.npy", np.asarray(ids, np.int64))
    del model
    names = engine_names(args)
    results: dict = {}
    if args.split:
        time_operator()
    for name in [] if args.memory_only else names:
        t0 = time.perf_counter()
        eng = Engine(name, paths, geometry)
        warm_up(eng, ids)
        for n in args.contexts:
            results[(name, n)] = quality_run(eng, ids, n, args.decode)
        del eng
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    for n in [] if args.memory_only else args.contexts:
        ref = logp(results[("ORT float", n)]["logits"])
        print(
            f"\ncontext {n}: prompt {n - args.decode} tokens in chunks of {CHUNK}, then {args.decode} "
            "teacher-forced decode steps"
        )
        base = results.get((SPEED_BASE, n))
        print(
            "| engine | KV bits/value held | KV MiB held | mean KL vs float | top-1 | decode tokens/s |"
            + (f" tokens/s ÷ {SPEED_BASE} |" if base else "")
        )
        print("|---|---|---|---|---|---|" + ("---|" if base else ""))
        for name in names:
            r = results[(name, n)]
            lq = logp(r["logits"])
            kl = float((np.exp(ref) * (ref - lq)).sum(axis=-1).mean())
            top1 = float((ref.argmax(-1) == lq.argmax(-1)).mean())
            bits = r["bytes"] * 8 / r["values"]
            print(
                f"| {name} | {bits:.2f} | {r['bytes'] / 2**20:.1f} | {kl:.2e} | {100 * top1:.1f} % | {r['tok_s']:.1f} |"
                + (f" {r['tok_s'] / base['tok_s']:.2f}x |" if base else "")
            )
    if args.split and not args.memory_only:
        print("\nwhere a decode step's time goes (ms per step; timers around the operator and cache.decode)")
        print("| engine | context | step | in the operator | of which cache.decode | rest of the graph |")
        print("|---|---|---|---|---|---|")
        for name in names:
            for n in args.contexts:
                step, op, dec = results[(name, n)]["split_ms"]
                print(f"| {name} | {n} | {step:.1f} | {op:.1f} | {dec:.1f} | {step - op:.1f} |")
    if args.no_memory:
        return 0
    print(
        f"\npeak resident set, each engine in its own process: prompt {args.memory_prompt} tokens, "
        f"then a {args.memory_loop}-step decode loop"
    )
    print(
        "| engine | RSS before prompt MiB | RSS after prompt MiB | peak RSS in loop MiB | peak - before MiB | "
        "KV MiB held at end | loop tokens/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.memory_engines:
        cmd = [
            sys.executable,
            __file__,
            "--memory-child",
            name,
            "--workdir",
            args.workdir,
            "--memory-prompt",
            str(args.memory_prompt),
            "--memory-loop",
            str(args.memory_loop),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(
                f"| {name} | failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode} |"
            )
            continue
        m = json.loads(out.stdout.strip().splitlines()[-1])
        mib = 2**20
        print(
            f"| {name} | {m['before'] / mib:.0f} | {m['after_prompt'] / mib:.0f} | {m['peak_loop'] / mib:.0f} "
            f"| {(m['peak_loop'] - m['before']) / mib:.0f} "
            f"| {m['held'] / mib:.1f} | {m['tok_s']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
