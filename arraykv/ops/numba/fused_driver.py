"""The decode-attention step shared by the fused CPU kernels (polar, int, vq).

A fused kernel computes, for one new query per head, ``softmax(scale · q Kᵀ) V`` straight from
a layer's codes. Everything but the scoring and accumulation of a span of tokens is the same
for every codec and lives here:

* the *step*: for every (batch, KV head) the kernel's ``prepare`` (query-side state of the
  head's GQA group), its ``span`` over the tokens (an online softmax per query head in tiles of
  :data:`TILE`: running maximum ``m``, sum ``l``, weighted value sum ``acc``), then its
  ``finish`` (the merge of the token splits with :func:`merge_top` / :func:`merge_splits`,
  whatever the codec adds, and the division by the denominator). Two variants: serial, on the
  calling thread, and parallel, with each head's tokens cut into ``splits`` spans run as
  ``prange`` tasks over (batch, KV head, span), each task with its own softmax state;
* the *plan* (:func:`plan`): how many threads (the policy of
  :mod:`arraykv.ops.numba.threads`) and token splits a call gets;
* the *launch* (:func:`run_step`): the serial variant, or the parallel one inside
  :func:`arraykv.ops.numba.threads.launch`.

A kernel module supplies ``alloc_state(b_n, h_n, g_n, d, args)`` (the query-side state, arrays
with leading ``(b_n, h_n)`` axes), ``prepare(q, b, h, scale, args, state, sb, sh)`` (fills slot
``(sb, sh)`` of it for head ``(b, h)``), ``span(b, h, t_lo, t_hi, args, state, sb, sh, m, l,
acc)``, ``finish(q, b, h, scale, args, state, sb, sh, m_sp, l_sp, acc_sp, out)`` and
``span_unit(args)`` (spans start at multiples of it), all ``@njit``; ``args`` is the kernel's
tuple of arrays and scalars. :func:`build_steps` compiles the two step variants for it.

Compilation: a jitted function that receives other jitted functions as arguments, or closes over
them, compiles per caller and is not cached on disk. :func:`build_steps` instead copies the
step templates below into the kernel module (its globals, its file, a name of its own), so each
kernel gets an ordinary module-level function that calls its ``prepare``/``span``/``finish`` as
globals: compiled once for the kernel's explicit signatures and cached on disk like any other.
The cache is keyed to the kernel module's file and the templates' bytecode; as everywhere with
Numba's cache, an edit of a jitted helper in another file (the merge helpers here, the tile
unpacking of ``polar_rows``) is not seen by it: clear ``__pycache__`` after such an edit.
"""

from __future__ import annotations

import math
import types

import numpy as np

try:
    import numba as nb
    from numba import types as nbt
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError("the CPU kernels need numba: pip install numba") from exc

from .threads import launch, threads_for

__all__ = ["TILE", "FASTMATH", "ro", "scaled_queries", "alloc_queries", "prepare_queries", "softmax_tile", "merge_top",
           "merge_splits", "build_steps", "plan", "split_count", "run_step"]

#: Tokens per tile of the online softmax.
TILE = 64
# Value-changing fast-math flags are left out ("nnan", "ninf"): the online softmax starts
# from -inf and compares against it.
FASTMATH = {"nsz", "arcp", "contract", "reassoc", "afn"}
#: Only the explicit ``prange`` runs on worker threads: array expressions (``np.zeros``, ...)
#: would each become a parallel region of their own, and every region wakes the threads.
_PRANGE_ONLY = {"prange": True, "comprehension": False, "setitem": False, "reduction": False, "numpy": False,
                "stencil": False, "fusion": False, "inplace_binop": False}


def ro(dtype, ndim, layout="A"):
    """The Numba type of a read-only array (arguments are compiled for any layout unless told)."""
    return nbt.Array(dtype, ndim, layout, readonly=True)


@nb.njit(inline="always")
def scaled_queries(q, b, h, scale, qs):
    """``qs[g] = scale · q[b, h·G + g]`` for the ``G`` query heads of KV head ``h``."""
    g_n, d = qs.shape
    sc = np.float32(scale)
    for g in range(g_n):
        for c in range(d):
            qs[g, c] = q[b, h * g_n + g, c] * sc


@nb.njit(inline="always")
def softmax_tile(srow, nt, m, l, acc, g):
    """One tile of query head ``g``'s online softmax: logits ``srow[:nt]`` become weights in place.

    ``m[g]``, ``l[g]``, ``acc[g]`` are the running maximum, ``Σ exp(logit − m)`` and weighted value
    sum; when the tile raises the maximum, ``l[g]`` and ``acc[g]`` are rescaled by
    ``exp(m_old − m_new)`` once, then ``srow[r] = exp(srow[r] − m)`` and ``l[g] += Σ_r srow[r]``.
    """
    mt = m[g]
    for r in range(nt):
        if srow[r] > mt:
            mt = srow[r]
    if mt > m[g]:
        c = np.float32(math.exp(m[g] - mt)) if m[g] > -np.inf else np.float32(0.0)
        l[g] *= c
        ag = acc[g]
        for j in range(ag.shape[0]):
            ag[j] *= c
        m[g] = mt
    lg = np.float32(0.0)
    for r in range(nt):
        p = np.float32(math.exp(srow[r] - mt))
        srow[r] = p
        lg += p
    l[g] += lg


@nb.njit(inline="always")
def merge_top(m_sp, g):
    """The largest running maximum of query head ``g`` over the token splits ``m_sp`` (splits, G)."""
    top = -np.inf
    for sp in range(m_sp.shape[0]):
        if m_sp[sp, g] > top:
            top = m_sp[sp, g]
    return top


@nb.njit(inline="always")
def merge_splits(m_sp, l_sp, acc_sp, g, top, y):
    """Log-sum-exp merge of the splits of query head ``g`` against ``top``: ``y += Σ c·acc``; returns ``Σ c·l``.

    ``c = exp(m_sp − top)`` per split; splits that saw no token (``m = -inf``) are skipped.
    """
    den = np.float32(0.0)
    d = acc_sp.shape[2]
    for sp in range(m_sp.shape[0]):
        if m_sp[sp, g] > -np.inf:
            c = np.float32(math.exp(m_sp[sp, g] - top))
            den += c * l_sp[sp, g]
            for j in range(d):
                y[j] += c * acc_sp[sp, g, j]
    return den


@nb.njit
def alloc_queries(b_n, h_n, g_n, d, args):
    """``alloc_state`` of a kernel whose query-side state is the scaled queries of every slot."""
    return (np.empty((b_n, h_n, g_n, d), np.float32),)


@nb.njit
def prepare_queries(q, b, h, scale, args, state, sb, sh):
    """``prepare`` of a kernel whose query-side state is the scaled queries (:func:`alloc_queries`)."""
    scaled_queries(q, b, h, scale, state[0][sb, sh])


def _step_serial(q, scale, n, h_n, args, splits, out):  # pragma: no cover - compiled per kernel
    """The whole step on the calling thread (``splits`` is ignored: one span per head)."""
    b_n, qh, d = q.shape
    g_n = qh // h_n
    state = alloc_state(1, 1, g_n, d, args)  # noqa: F821 - the kernel module's
    m = np.empty((1, g_n), np.float32)
    l = np.empty((1, g_n), np.float32)
    acc = np.empty((1, g_n, d), np.float32)
    for b in range(b_n):
        for h in range(h_n):
            prepare(q, b, h, scale, args, state, 0, 0)  # noqa: F821
            m[:] = -np.inf
            l[:] = 0.0
            acc[:] = 0.0
            if n > 0:
                span(b, h, 0, n, args, state, 0, 0, m[0], l[0], acc[0])  # noqa: F821
            finish(q, b, h, scale, args, state, 0, 0, m, l, acc, out)  # noqa: F821


def _step_parallel(q, scale, n, h_n, args, splits, out):  # pragma: no cover - compiled per kernel
    """The step with each (batch, KV head)'s tokens cut into ``splits`` spans run on Numba's threads."""
    b_n, qh, d = q.shape
    g_n = qh // h_n
    state = alloc_state(b_n, h_n, g_n, d, args)  # noqa: F821
    for b in range(b_n):
        for h in range(h_n):
            prepare(q, b, h, scale, args, state, b, h)  # noqa: F821
    m = np.empty((b_n, h_n, splits, g_n), np.float32)
    l = np.empty((b_n, h_n, splits, g_n), np.float32)
    acc = np.empty((b_n, h_n, splits, g_n, d), np.float32)
    unit = span_unit(args)  # noqa: F821
    per = ((n + unit - 1) // unit + splits - 1) // splits * unit
    for task in nb.prange(b_n * h_n * splits):
        sp = task % splits
        bh = task // splits
        b = bh // h_n
        h = bh % h_n
        t_lo = min(n, sp * per)
        t_hi = min(n, t_lo + per)
        # the task's own state (no cache line shared with another task while it runs)
        m_t = np.full(g_n, -np.inf, np.float32)
        l_t = np.zeros(g_n, np.float32)
        acc_t = np.zeros((g_n, d), np.float32)
        if t_hi > t_lo:
            span(b, h, t_lo, t_hi, args, state, b, h, m_t, l_t, acc_t)  # noqa: F821
        m[b, h, sp] = m_t
        l[b, h, sp] = l_t
        acc[b, h, sp] = acc_t
    for b in range(b_n):
        for h in range(h_n):
            finish(q, b, h, scale, args, state, b, h, m[b, h], l[b, h], acc[b, h], out)  # noqa: F821


def _copy(template, namespace: dict, name: str):
    """``template`` as a function of the module whose globals are ``namespace``, named ``name``."""
    code = template.__code__.replace(co_name=name, co_qualname=name, co_filename=namespace["__file__"])
    fn = types.FunctionType(code, namespace, name)
    fn.__module__ = namespace["__name__"]
    fn.__qualname__ = name
    fn.__doc__ = template.__doc__
    return fn


def build_steps(namespace: dict, sigs) -> tuple:
    """Compile ``(step_serial, step_parallel)`` for the kernel module whose globals are ``namespace``.

    Parameters
    ----------
    namespace : dict
        The kernel module's ``globals()``; it defines ``alloc_state``, ``prepare``, ``span``,
        ``finish`` and ``span_unit`` (see the module notes).
    sigs : list of numba signatures
        ``void(q, scale, n, h_n, args, splits, out)`` for each argument type the kernel takes.

    Returns
    -------
    tuple of two Numba dispatchers, compiled for ``sigs`` (and cached on disk).
    """
    opts = dict(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
    serial = nb.njit(sigs, **opts)(_copy(_step_serial, namespace, "_step_serial"))
    parallel = nb.njit(sigs, parallel=_PRANGE_ONLY, **opts)(_copy(_step_parallel, namespace, "_step_parallel"))
    return serial, parallel


def plan(bh: int, n: int, work: int, min_span: int) -> tuple:
    """``(threads, token splits per head)`` for ``bh`` (batch, KV head) pairs of ``n`` tokens.

    ``(1, 1)`` (the serial step, on the calling thread) when the threading policy gives ``work``
    values one thread; otherwise enough spans for two tasks per thread, each of at least
    ``min_span`` tokens.
    """
    threads = threads_for(work)
    if threads == 1:
        return 1, 1
    return threads, split_count(bh, n, threads, min_span)


def split_count(bh: int, n: int, threads: int, min_span: int) -> int:
    """Token splits per (batch, head): two tasks per thread, each of at least ``min_span`` tokens."""
    want = max(1, -(-2 * threads // bh))
    return max(1, min(want, n // max(min_span, 1) or 1))


def run_step(serial, parallel, threads: int, splits: int, work: int, args: tuple, out) -> None:
    """Run one step: ``serial(*args, 1, out)`` on one thread or a single task, else ``parallel`` in a launch."""
    q, h_n = args[0], args[3]
    if threads == 1 or q.shape[0] * h_n * splits == 1:
        serial(*args, 1, out)
        return
    with launch(work):
        parallel(*args, splits, out)
