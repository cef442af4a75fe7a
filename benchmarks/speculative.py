"""Speculative decoding on SmolLM2-135M: acceptance and speed against plain greedy decoding.

For each cache method the target first decodes ``--new`` tokens greedily (plain decoding: one
``decode`` per token), then with each draft of ``--drafts`` and block size of ``--k``,
sequentially and with the draft in a second thread (``concurrent``). Every run starts from the
same prompt in a fresh cache; the configurations take turns for ``--rounds`` rounds and each
one's median time is reported. Columns: acceptance (proposals the target kept), tokens per
second of decoding (the prompt's prefill excluded), the speed-up over plain decoding in the
same run, and whether the output equals plain greedy decoding (``tie@i`` when the first
difference falls where plain decoding's two best logits were closer than 1e-4).

Drafts: ``layers:N`` runs the model's first N layers and its output head on the target's own
cache (self-speculation); ``cache:METHOD`` runs the whole model over a cache of its own;
``ngram:N`` proposes what followed the latest earlier occurrence of the last N tokens.

Run::

    python benchmarks/speculative.py --methods dense pqo4 int4 --drafts layers:8 layers:15 cache:pqo2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics


def main(argv=None) -> int:
    from arraykv import eval as ev
    from arraykv.integrations.decoder.drafts import draft_from_spec
    from arraykv.integrations.decoder.gguf_loading import load_model
    from arraykv.integrations.decoder.speculative import greedy_agreement, greedy_with_gaps, speculative_generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["dense", "pqo4", "int4"])
    ap.add_argument("--drafts", nargs="+", default=["layers:10", "layers:20", "cache:pqo2", "ngram:3"])
    ap.add_argument("--k", nargs="+", type=int, default=[4])
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt: this many tokens of the shipped novel")
    ap.add_argument("--prompt", default=None, help="a user message for the chat model instead")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-concurrent", action="store_true", help="skip the two-thread runs")
    ap.add_argument(
        "--verify",
        default="auto",
        choices=["auto", "decode", "batched", "prefill"],
        help="how the target runs a block (speculative_generate's verify)",
    )
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)

    model = load_model(args.model, quiet=True)
    if args.prompt:
        ids = model.tokenizer.encode(model.tokenizer.chat_prompt(args.prompt))
    else:
        ids = ev.builtin_token_ids(model, args.prompt_tokens)
    modes = [False] if args.no_concurrent else [False, True]
    # a prompt-lookup draft runs no model, so it has nothing to run beside the target
    configs = [(d, k, c) for d in args.drafts for k in args.k for c in modes if not (c and d.startswith("ngram"))]
    print(
        f"# speculative decoding, SmolLM2-135M, {len(ids)}-token prompt, {args.new} new tokens, "
        f"{args.rounds} rounds, verify={args.verify}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cpus"
    )
    print()
    print("| method | draft | k | threads | acceptance | tokens/s | vs plain | equals plain greedy |")
    print("|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        plain_t, spec_t = [], {c: [] for c in configs}
        stats, verdicts = {}, {}
        ref = gaps = None
        for _ in range(args.rounds):
            toks, g, secs = greedy_with_gaps(model, ids, args.new, model.make_cache(method))
            ref, gaps = toks, g
            plain_t.append(secs)
            for cfg in configs:
                d, k, conc = cfg
                r = speculative_generate(
                    model,
                    ids,
                    args.new,
                    cache=model.make_cache(method),
                    draft=draft_from_spec(d),
                    k=k,
                    concurrent=conc,
                    verify=args.verify,
                    stop_at_eos=False,
                )
                spec_t[cfg].append(r.seconds)
                stats[cfg] = r
                v = greedy_agreement(ref, gaps, r.tokens)
                if cfg not in verdicts or verdicts[cfg]["equal"]:  # keep a round that differed
                    verdicts[cfg] = v
        plain_s = statistics.median(plain_t)
        plain_tps = (args.new - 1) / plain_s
        print(f"| {method} | plain | - | 1 | - | {plain_tps:.1f} | 1.00x | - |")
        for cfg in configs:
            d, k, conc = cfg
            s = statistics.median(spec_t[cfg])
            v = verdicts[cfg]
            eq = (
                "yes"
                if v["equal"]
                else (
                    f"tie@{v['first_difference']}"
                    if v["tie"]
                    else f"NO@{v['first_difference']} (gap {v['margin']:.2g})"
                )
            )
            print(
                f"| {method} | {d} | {k} | {2 if conc else 1} | {stats[cfg].acceptance_rate:.0%} | "
                f"{(args.new - 1) / s:.1f} | {plain_s / s:.2f}x | {eq} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
