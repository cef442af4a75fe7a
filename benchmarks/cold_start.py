"""Cold start: a new process loads a model and answers a few tokens, with empty and with warm caches.

Each run is a new Python process. The cold run gets an empty Numba cache directory
(``NUMBA_CACHE_DIR``) and an empty weight cache (``ARRAYKV_WEIGHT_CACHE``); the warm run reuses
both. The child prints the time to import, to load the model, to the first new token and in
all, and every Numba compilation it ran (function, signature, seconds of its own, without the
functions it compiled inside), so a profile of the cold start is one command::

    python benchmarks/cold_start.py                      # SmolLM2 and Gemma-3-270M, pqo4 and int4
    python benchmarks/cold_start.py --models smollm2 --methods pqo4 --tokens 8

``--env KEY=VALUE`` passes settings to the children (``NUMBA_NUM_THREADS=1``,
``ARRAYKV_PRECOMPILE=0`` ...). ``--child`` is the measured process itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()

MODELS = {"smollm2": None, "gemma3": "gemma3-270m"}
PROMPT = "The capital of France is"


class _Compiles:
    """Numba compile events of this process: ``(qualname, signature, inclusive s, own s)``."""

    def __init__(self) -> None:
        self.stack: list = []
        self.done: list = []

    def listener(self):
        from numba.core import event

        rec = self

        class _L(event.Listener):
            def on_start(self, ev):
                rec.stack.append([_name(ev), time.perf_counter(), 0.0])

            def on_end(self, ev):
                name, start, inner = rec.stack.pop()
                took = time.perf_counter() - start
                if rec.stack:
                    rec.stack[-1][2] += took
                rec.done.append((name[0], name[1], took, took - inner, len(rec.stack)))

        return _L()


def _name(ev) -> tuple:
    data = getattr(ev, "data", None) or {}
    disp = data.get("dispatcher")
    py = getattr(disp, "py_func", None)
    qual = f"{getattr(py, '__module__', '?')}.{getattr(py, '__qualname__', '?')}"
    args = data.get("args") or ()
    return qual, "(" + ", ".join(str(a) for a in args) + ")"


def child(model_name: str, method: str, tokens: int) -> None:
    """The measured process: load, answer, print one JSON line."""
    t_imp = time.perf_counter()
    from numba.core import event

    comp = _Compiles()
    event.register("numba:compile", comp.listener())
    from arraykv.integrations.decoder.gguf_loading import load_model

    t_load = time.perf_counter()
    model = load_model(MODELS[model_name], quiet=True)
    t_loaded = time.perf_counter()
    first: list = []
    ids = model.generate(
        PROMPT,
        tokens,
        cache=model.make_cache(method),
        stop_at_eos=False,
        on_token=lambda t: first.append(time.perf_counter()) if not first else None,
    )
    t_end = time.perf_counter()
    out = {
        "import_s": t_load - t_imp,
        "load_s": t_loaded - t_load,
        "first_token_s": first[0] - T0,
        "total_s": t_end - T0,
        "tokens": [int(i) for i in ids],
        "text": model.tokenizer.decode(ids),
        "compiles": comp.done,
    }
    print("RESULT " + json.dumps(out))


def run_child(model: str, method: str, tokens: int, env: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, method, str(tokens)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not line:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    res = json.loads(line[-1][7:])
    res["wall_s"] = wall
    return res


def report(label: str, r: dict, top: int) -> None:
    comps = r["compiles"]
    own = sum(c[3] for c in comps)
    print(
        f"{label:<22} wall {r['wall_s']:6.1f} s  import {r['import_s']:5.1f}  load {r['load_s']:5.1f}  "
        f"first token {r['first_token_s']:6.1f}  total {r['total_s']:6.1f}  "
        f"compiles {len(comps):3d} ({own:.1f} s)"
    )
    by_fn: dict = {}
    for qual, sig, _inc, own_s, _depth in comps:
        n, s, sigs = by_fn.get(qual, (0, 0.0, []))
        by_fn[qual] = (n + 1, s + own_s, sigs + [sig])
    for qual, (n, s, sigs) in sorted(by_fn.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {s:6.1f} s  {n:2d}x  {qual}")
        for sig in sigs[:3]:
            print(f"                 {sig[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "METHOD", "TOKENS"))
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--methods", nargs="+", default=["pqo4", "int4"])
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--top", type=int, default=12, help="functions listed per run, by compile time")
    ap.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    results = {}
    for model in args.models:
        for method in args.methods:
            tmp = tempfile.mkdtemp(prefix="arraykv_cold_")
            env = dict(os.environ)
            env.update(kv.split("=", 1) for kv in args.env)
            env["NUMBA_CACHE_DIR"] = os.path.join(tmp, "numba")
            env["ARRAYKV_WEIGHT_CACHE"] = os.path.join(tmp, "weights")
            try:
                for phase in ("cold", "warm"):
                    r = run_child(model, method, args.tokens, env)
                    results[f"{model}/{method}/{phase}"] = r
                    report(f"{model} {method} {phase}", r, args.top)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            cold, warm = results[f"{model}/{method}/cold"], results[f"{model}/{method}/warm"]
            print(
                f"  -> cold {cold['wall_s']:.1f} s, warm {warm['wall_s']:.1f} s; target 2 x warm + 10 = "
                f"{2 * warm['wall_s'] + 10:.1f} s; same tokens: {cold['tokens'] == warm['tokens']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
