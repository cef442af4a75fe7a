"""Cache methods at long context on SmolLM2-135M: needle retrieval and KL after long prefixes.

Two tables, both measured in this run (Markdown):

1. needle retrieval (:func:`arraykv.eval.needle_grid`): a 5-digit pass key hidden at
   ``--depths`` of ``--lengths`` tokens of filler; per cell whether the greedy answer holds the
   key and the key's teacher-forced log-probability; cells retrieved overall and where the exact
   cache retrieves; bits/value at the longest length;
2. long-text quality (:func:`arraykv.eval.long_text_quality`): after ``--prefix-lengths``
   tokens of Pride and Prejudice (ch. 1-6), ``--positions`` tokens decoded through every cache;
   mean KL(exact || method), top-1 agreement, perplexity change and bits/value per length.

Every method starts from one exact chunked prefill of the prompt (``--prefill-mode exact``), or
runs the chunked prefill through its own cache (``--prefill-mode cache``). Then the wall time
and the peak memory: ``tracemalloc`` peak of the run (NumPy reports its buffers to it) and the
process's max RSS (``resource.getrusage``).

Run from the repository root::

    python benchmarks/long_context.py                               # dense pqo4 pqo3 pqo2 int8 int4, 2k-8k
    python benchmarks/long_context.py --methods dense pqo4 --lengths 2048 --no-kl
    python benchmarks/long_context.py --plot long_context.png
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from arraykv import cli_longctx

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli_longctx.add_arguments(ap)
    ap.set_defaults(trace_memory=True)
    args = ap.parse_args(argv)
    print(f"command: python benchmarks/long_context.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    return cli_longctx.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
