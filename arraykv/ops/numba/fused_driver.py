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
:class:`typing.NamedTuple` of arrays and scalars, its fields read by name. :func:`build_steps`
compiles the two step variants for it.

A Python entry builds its named tuple and hands :func:`run_step` a :class:`Step`. The compiled
steps take the fields as a plain tuple, in the order of the class (Numba converts a plain tuple
of arrays to the explicit signatures' read-only, any-layout array types, never a named one),
and make it the named tuple again before the kernel's functions see it.

Compilation: a jitted function that receives other jitted functions as arguments, or closes over
them, compiles per caller and is not cached on disk. :func:`build_steps` instead copies the
step templates below into the kernel module (its globals, its file, a name of its own), so each
kernel gets an ordinary module-level function that calls its ``prepare``/``span``/``finish`` as
globals: compiled for the kernel's explicit signatures and cached on disk like any other, each
variant and signature only when a call first needs it (:class:`LazyStep`). The adapters a kernel
module gives the step (``alloc_state``, ``prepare``, ``span``, ``finish``, ``span_unit``) are
``@njit(inline="always")``: inlined into the step at Numba's IR level, they are not compiled
as functions of their own, each of which LLVM would optimise and turn into machine code once
more with everything it calls (measured: a cold first pqo4 decode call compiled in 560 s
instead of 674 s on a loaded two-core machine, with bit-identical output).
The cache is keyed to the kernel module's file and the templates' bytecode; as everywhere with
Numba's cache, an edit of a jitted helper in another file (the merge helpers here, the tile
unpacking of ``polar.rows``) is not seen by it: clear ``__pycache__`` after such an edit.
"""

from __future__ import annotations

import math
import threading
import types
from typing import Any, NamedTuple

import numba as nb
import numpy as np
from numba import types as nbt

from .threads import launch, threads_for

__all__ = [
    "TILE",
    "FASTMATH",
    "ro",
    "scaled_queries",
    "alloc_queries",
    "prepare_queries",
    "softmax_tile",
    "tile_dots",
    "tile_add_rows",
    "merge_top",
    "merge_splits",
    "ScaledQueries",
    "Step",
    "LazyStep",
    "build_steps",
    "plan",
    "split_count",
    "run_step",
]

#: Tokens per tile of the online softmax.
TILE = 64
# Value-changing fast-math flags are left out ("nnan", "ninf"): the online softmax starts
# from -inf and compares against it.
FASTMATH = {"nsz", "arcp", "contract", "reassoc", "afn"}
#: Only the explicit ``prange`` runs on worker threads: array expressions (``np.zeros``, ...)
#: would each become a parallel region of their own, and every region wakes the threads.
_PRANGE_ONLY = {
    "prange": True,
    "comprehension": False,
    "setitem": False,
    "reduction": False,
    "numpy": False,
    "stencil": False,
    "fusion": False,
    "inplace_binop": False,
}


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


#: 2**f = Σ_k c_k f**k on |f| <= 1/2 (Taylor: c_k = ln(2)**k / k!; relative error below 6e-9)
_EXP2 = (
    0.6931471805599453,
    0.2402265069591007,
    0.05550410866482158,
    0.009618129107628477,
    0.0013333558146428443,
    0.00015403530393381606,
    1.525273380405984e-05,
)


@nb.njit(inline="always")
def softmax_tile(srow, nt, m, l, acc, g, ebits):
    """One tile of query head ``g``'s online softmax: logits ``srow[:nt]`` become weights in place.

    ``m[g]``, ``l[g]``, ``acc[g]`` are the running maximum, ``Σ exp(logit − m)`` and weighted value
    sum; when the tile raises the maximum, ``l[g]`` and ``acc[g]`` are rescaled by
    ``exp(m_old − m_new)`` once, then ``srow[r] = exp(srow[r] − m)`` and ``l[g] += Σ_r srow[r]``.
    ``ebits`` (int32, at least ``nt``) is scratch.

    Notes
    -----
    ``exp(x) = 2**n · 2**f`` with ``n = round(x log2 e)``, ``|f| <= 1/2``: a degree-7 polynomial
    for ``2**f`` and the float32 exponent field ``(n + 127) << 23`` for ``2**n``, written as
    loops the compiler vectorizes (a call of ``math.exp`` per weight does not: without SVML it
    is one scalar call each). ``x`` is clamped at ``-126 ln 2``, where a weight is ``1.2e-38``
    instead of 0 (below the float32 resolution of ``l >= 1``).
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
    c1, c2, c3, c4, c5, c6, c7 = _EXP2
    for r in range(nt):
        y = (srow[r] - mt) * np.float32(1.4426950408889634)
        if y < np.float32(-126.0):
            y = np.float32(-126.0)
        n = np.floor(y + np.float32(0.5))
        f = y - n
        ebits[r] = (np.int32(n) + 127) << 23
        srow[r] = np.float32(1.0) + f * (
            np.float32(c1)
            + f
            * (
                np.float32(c2)
                + f
                * (
                    np.float32(c3)
                    + f * (np.float32(c4) + f * (np.float32(c5) + f * (np.float32(c6) + f * np.float32(c7))))
                )
            )
        )
    scale2 = ebits.view(np.float32)
    lg = np.float32(0.0)
    for r in range(nt):
        p = srow[r] * scale2[r]
        srow[r] = p
        lg += p
    l[g] += lg


# The scalar tile products of the kernels (their paths without 16-lane vectors). They index
# their arrays directly instead of taking row views inside the loops: every view is a
# reference-counted object (two atomic operations), which in a loop costs more than the arithmetic.


@nb.njit(inline="always")
def tile_dots(q, x, n, r, s):
    """``s[g, i] = Σ_{j < r} q[g, j] · x[i, j]`` for rows ``i < n`` of ``x`` and every row ``g`` of ``q``.

    Four rows of ``x`` per pass, four independent sums, each pass read once for every ``g``.
    """
    g_n = q.shape[0]
    n4 = n - n % 4
    for i in range(0, n4, 4):
        for g in range(g_n):
            y0 = np.float32(0.0)
            y1 = np.float32(0.0)
            y2 = np.float32(0.0)
            y3 = np.float32(0.0)
            for j in range(r):
                w = q[g, j]
                y0 += w * x[i, j]
                y1 += w * x[i + 1, j]
                y2 += w * x[i + 2, j]
                y3 += w * x[i + 3, j]
            s[g, i] = y0
            s[g, i + 1] = y1
            s[g, i + 2] = y2
            s[g, i + 3] = y3
    for i in range(n4, n):
        for g in range(g_n):
            y = np.float32(0.0)
            for j in range(r):
                y += q[g, j] * x[i, j]
            s[g, i] = y


@nb.njit(inline="always")
def tile_add_rows(w, x, n, r, acc):
    """``acc[g, j] += Σ_{i < n} w[g, i] · x[i, j]`` for ``j < r`` and every row ``g`` of ``w``.

    Four rows of ``x`` per pass over the accumulators, each pass read once for every ``g``.
    """
    g_n = w.shape[0]
    n4 = n - n % 4
    for i in range(0, n4, 4):
        for g in range(g_n):
            w0 = w[g, i]
            w1 = w[g, i + 1]
            w2 = w[g, i + 2]
            w3 = w[g, i + 3]
            for j in range(r):
                acc[g, j] += w0 * x[i, j] + w1 * x[i + 1, j] + w2 * x[i + 2, j] + w3 * x[i + 3, j]
    for i in range(n4, n):
        for g in range(g_n):
            w0 = w[g, i]
            for j in range(r):
                acc[g, j] += w0 * x[i, j]


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


class ScaledQueries(NamedTuple):
    """The query-side state of a kernel that needs only its scaled queries (:func:`alloc_queries`)."""

    #: float32 (b_n, h_n, G, d): ``scale · q`` of the GQA group of each (batch, KV head) slot
    qs: Any


@nb.njit(inline="always")
def alloc_queries(b_n, h_n, g_n, d, args):
    """``alloc_state`` of a kernel whose query-side state is the scaled queries of every slot."""
    return ScaledQueries(np.empty((b_n, h_n, g_n, d), np.float32))


@nb.njit(inline="always")
def prepare_queries(q, b, h, scale, args, state, sb, sh):
    """``prepare`` of a kernel whose query-side state is the scaled queries (:func:`alloc_queries`)."""
    scaled_queries(q, b, h, scale, state.qs[sb, sh])


def _step_serial(q, scale, n, h_n, args, splits, out):  # pragma: no cover - compiled per kernel
    """The whole step on the calling thread (``splits`` is ignored: one span per head)."""
    args = Args(*args)  # noqa: F821 - the kernel's named tuple class (its own name: see _copy)
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
    args = Args(*args)  # noqa: F821
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


def _copy(template, namespace: dict, name: str, args_type: type):
    """``template`` as a function of the module whose globals are ``namespace``, named ``name``.

    The template's global ``Args`` becomes ``args_type``'s own name in that module: Numba's
    parallel lowering rebuilds a named tuple inside a ``prange`` body by the name of the global
    it was made from, spelt as its class's name.
    """
    if namespace.get(args_type.__name__) is not args_type:
        raise ValueError(f"{args_type.__name__} is not a global of {namespace['__name__']}")
    names = tuple(args_type.__name__ if n == "Args" else n for n in template.__code__.co_names)
    code = template.__code__.replace(co_name=name, co_qualname=name, co_filename=namespace["__file__"], co_names=names)
    fn = types.FunctionType(code, namespace, name)
    fn.__module__ = namespace["__name__"]
    fn.__qualname__ = name
    fn.__doc__ = template.__doc__
    return fn


class LazyStep:
    """One step variant of a kernel, compiled per (head_dim variant, signature) on the first call that needs it.

    Compiling every variant for every signature at import (as ``nb.njit(sigs)`` does) costs a
    process the parallel step and the unused parameter dtypes and head dims too, each a full
    compilation of the kernel's span loop; a first decode call needs one. ``pick(args)`` (a
    Python function of the call's named tuple ``args``, default: always 0) says which signature a call
    takes; ``fns`` maps a head_dim (0: any other) to the step function compiled for it.
    Compiled code is cached on disk as before.

    A call is ``step(q, scale, n, h_n, args, splits, out)`` with ``args`` the kernel's named tuple;
    the compiled function receives its fields as a plain tuple (see the module notes).
    """

    def __init__(self, fns: dict, sigs, pick, opts):
        self._fns, self._sigs, self._pick, self._opts = fns, list(sigs), pick, opts
        self._disp: dict = {}

    def __call__(self, q, scale, n, h_n, args, splits, out):
        return self.compiled(q.shape[2], args)(q, scale, n, h_n, tuple(args), splits, out)

    def compiled(self, d: int, args):
        """The compiled function a call of head_dim ``d`` and arguments ``args`` runs (compiled,
        or loaded from the disk cache, on first use); it takes ``args`` as a plain tuple."""
        key = (d if d in self._fns else 0, self._pick(args) if self._pick is not None else 0)
        disp = self._disp.get(key)
        if disp is None:
            disp = self._compile(key)
        return disp

    def _compile(self, key):
        with _COMPILE_LOCK:
            if key not in self._disp:
                self._disp[key] = nb.njit([self._sigs[key[1]]], **self._opts)(self._fns[key[0]])
        return self._disp[key]

    def compile_all(self) -> None:
        """Compile (or load from the disk cache) every head_dim variant and signature now."""
        for dim in self._fns:
            for i in range(len(self._sigs)):
                self._compile((dim, i))


_COMPILE_LOCK = threading.Lock()


def _specialised(namespace: dict, dim: int) -> dict:
    """A copy of a kernel module's globals whose ``_D`` is ``dim`` and whose own jitted functions are
    re-made over it, so that code reading ``d = _D if _D else ...`` sees a compile-time constant
    (the loops over channels then unroll into whole vectors)."""
    ns = dict(namespace, _D=dim)
    for name, obj in namespace.items():
        py = getattr(obj, "py_func", None)
        if py is not None and py.__module__ == namespace["__name__"]:
            fn = types.FunctionType(py.__code__, ns, py.__name__, py.__defaults__, py.__closure__)
            ns[name] = nb.njit(**{k: v for k, v in obj.targetoptions.items() if k != "nopython"})(fn)
    return ns


def build_steps(namespace: dict, args_type: type, sigs, pick=None, dims=()) -> tuple:
    """``(step_serial, step_parallel)`` for the kernel module whose globals are ``namespace``.

    Parameters
    ----------
    namespace : dict
        The kernel module's ``globals()``; it defines ``alloc_state``, ``prepare``, ``span``,
        ``finish`` and ``span_unit`` (see the module notes).
    args_type : type
        The kernel's :class:`typing.NamedTuple` class of ``args``, a global of the module under
        its own name.
    sigs : list of numba signatures
        ``void(q, scale, n, h_n, args, splits, out)`` for each argument type the kernel takes,
        ``args`` a plain ``Tuple`` of the types of ``args_type``'s fields, in their order.
    pick : callable or None
        ``pick(args) -> int``: the index in ``sigs`` of a call's named tuple ``args`` (None: 0).
    dims : tuple of int
        Head dims that get steps of their own, compiled with the module global ``_D`` set to
        the dim (:func:`_specialised`); other dims run the steps of the module as it is.

    Returns
    -------
    tuple of two :class:`LazyStep`, each compiled per head_dim variant and signature on first use
    (and cached on disk).
    """
    opts = dict(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
    spaces = {0: namespace, **{dim: _specialised(namespace, dim) for dim in dims}}
    serial = LazyStep(
        {
            dim: _copy(_step_serial, ns, f"_step_serial_d{dim}" if dim else "_step_serial", args_type)
            for dim, ns in spaces.items()
        },
        sigs,
        pick,
        opts,
    )
    parallel = LazyStep(
        {
            dim: _copy(_step_parallel, ns, f"_step_parallel_d{dim}" if dim else "_step_parallel", args_type)
            for dim, ns in spaces.items()
        },
        sigs,
        pick,
        dict(opts, parallel=_PRANGE_ONLY),
    )
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


class Step(NamedTuple):
    """The arguments of one step call besides its token splits and output (:func:`run_step`)."""

    #: float32 (batch, q_heads, head_dim), C-contiguous: one query per head
    q: Any
    #: softmax scale
    scale: float
    #: tokens of the kernel's quantized part
    n: int
    #: KV heads
    h_n: int
    #: the kernel's named tuple of arrays and scalars
    args: Any


def run_step(serial, parallel, threads: int, splits: int, work: int, step: Step, out) -> None:
    """Run one step: ``serial(*step, 1, out)`` on one thread or a single task, else ``parallel`` in a launch."""
    if threads == 1 or step.q.shape[0] * step.h_n * splits == 1:
        serial(*step, 1, out)
        return
    with launch(work):
        parallel(*step, splits, out)
