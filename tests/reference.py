"""Slow, obviously correct reference implementations (plain loops over NumPy float64).

Every fast path in the library is compared against these on fresh random inputs.
"""

from __future__ import annotations

import math

import numpy as np


def attention_loops(q, k, v, scale, logit_bias=None, causal=True):
    """Attention one (batch, head, query) at a time.

    q (B, Hq, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) -> (B, Hq, T, Dv), float64.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    b, hq, t, d = q.shape
    _, hkv, s, _ = k.shape
    g = hq // hkv
    out = np.zeros((b, hq, t, v.shape[-1]))
    for bi in range(b):
        for h in range(hq):
            kh = h // g
            for i in range(t):
                limit = s - t + i if causal else s - 1
                logits = []
                for j in range(limit + 1):
                    x = scale * sum(q[bi, h, i, c] * k[bi, kh, j, c] for c in range(d))
                    if logit_bias is not None:
                        x += float(logit_bias[bi, h, i, j])
                    logits.append(x)
                m = max(logits)
                w = [math.exp(x - m) for x in logits]
                z = sum(w)
                for j in range(limit + 1):
                    out[bi, h, i] += (w[j] / z) * v[bi, kh, j]
    return out
