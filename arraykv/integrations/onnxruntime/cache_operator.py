"""The ``ArrayKVAttention`` custom operator: attention served by an arraykv cache inside ONNX Runtime.

ONNX Runtime runs operators written in Python through ``onnxruntime-extensions``: a function
decorated with ``onnxruntime_extensions.onnx_op`` is called, with NumPy arrays, for every node
of its type once the extensions library is registered on the session
(``SessionOptions.register_custom_ops_library(get_library_path())``). :func:`ensure_registered`
defines that function once per process; :func:`session_options` returns options with the
library registered.

A node (inserted by :func:`arraykv.integrations.onnxruntime.graph_rewrite.rewrite_with_cache_op`) takes
``(query, new_key, new_value)`` and has attributes ``handle`` (str), ``layer`` (int) and
``scale`` (float). ``handle`` names a :class:`CacheSlot` registered with :func:`register`:
the object through which the Python side says which cache the next run stores into and
whether the run is a prompt (``cache.prefill`` of every new token, causal attention over what
it returns) or a decode step (``cache.decode`` of one token per sequence; a
:class:`~arraykv.Fused` answer is the attention output, a :class:`~arraykv.Dequantized` one
goes through the reference attention with its ``logit_bias``). These are the calls and the
attention functions of :class:`~arraykv.integrations.decoder.model.DecoderModel`, so the graph and the
NumPy decoder store and attend the same way.

Errors: an exception raised by a Python operator terminates the process under
onnxruntime-extensions 0.15.2 and onnxruntime 1.32, so the operator never raises: it records
the exception on the slot (:attr:`CacheSlot.error`), returns NaN, and every later node of the
run returns NaN without touching the cache; :class:`~arraykv.integrations.onnxruntime.graph_decoder.OrtGraphDecoder`
raises the recorded exception after the run and takes back what earlier layers stored. A graph
run without a registered slot (outside the decoder) gives NaN logits.

The call itself: the package's own invoker turns each answer into a Python list and back,
which cost about 0.15 ms a decode-shaped call and 156 ms for a 512-token chunk's answer (2-core
machine, loaded); :func:`_install_invoker` hands the array over instead (15 µs and 0.33 ms).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

from ..common.optional import require

__all__ = [
    "CacheSlot",
    "register",
    "custom_op_api",
    "ensure_registered",
    "session_options",
    "attend_from_cache",
    "run_prompt",
]

_SLOTS: weakref.WeakValueDictionary[str, CacheSlot] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()
_REGISTERED = [False]


class CacheSlot:
    """What the ``ArrayKVAttention`` nodes of one graph read: the cache and the kind of step.

    Attributes
    ----------
    cache : CompressedKVCache or None
        Set before a run, cleared after it.
    mode : {"prefill", "decode"}
    error : BaseException or None
        The exception an operator raised during the last run (ONNX Runtime reports only its text).
    kernels : {"parallel", "serial"}
        How a decode step's CPU kernels use Numba's threads while NumPy's OpenBLAS runs several
        (:func:`arraykv.ops.numba.threads.beside_blas`). Inside a graph the products between the
        layers are ONNX Runtime's, not OpenBLAS's, so nothing spins on the cores a parallel
        kernel wants, as long as ONNX Runtime's own threads do not spin either
        (``session.intra_op.allow_spinning = "0"``, which the decoder sets by default): then
        ``"parallel"``. Measured on SmolLM2 at 8k tokens, 2 cores, pqo4 in the graph: 120 ms
        a step with serial kernels, 72 ms with parallel ones.
    """

    def __init__(self, kernels: str = "parallel") -> None:
        if kernels not in ("parallel", "serial"):
            raise ValueError(f"kernels must be 'parallel' or 'serial', received {kernels!r}")
        self.cache: Any = None
        self.mode = "prefill"
        self.error: BaseException | None = None
        self.kernels = kernels


def register(handle: str, slot: CacheSlot) -> None:
    """Make ``slot`` the one read by nodes whose ``handle`` attribute is ``handle`` (held weakly)."""
    with _LOCK:
        _SLOTS[handle] = slot


def attend_from_cache(slot: CacheSlot, layer: int, scale: float, q: Any, k: Any, v: Any) -> Any:
    """Store ``k``/``v`` in layer ``layer`` of ``slot.cache`` and return the attention output.

    Parameters
    ----------
    slot : CacheSlot
    layer : int
    scale : float
        Softmax scale applied to ``q · k``.
    q : numpy.ndarray, float32, shape (b, X, Y, d)
        ``X * Y = q_heads * t``, the query heads in order (``arraykv.integrations.onnxruntime.graph_rewrite``).
    k, v : numpy.ndarray, float32, shape (b, kv_heads, t, d)

    Returns
    -------
    numpy.ndarray, float32, shape of ``q``
    """
    np, to_numpy, beside_blas, Fused, attend_chunk, attend_one = _runtime()
    cache = slot.cache
    if cache is None:
        raise RuntimeError(
            "the ArrayKVAttention node ran with no cache attached; run the graph through OrtGraphDecoder"
        )
    b, hkv, t, d = (int(s) for s in k.shape)
    heads = int(q.size) // (b * t * d)
    if heads * b * t * d != q.size or heads % hkv:
        raise ValueError(
            f"layer {layer}: queries of shape {q.shape} do not hold a whole number of query heads "
            f"for keys of shape {k.shape}"
        )
    q4 = np.ascontiguousarray(q, dtype=np.float32).reshape(b, heads, t, d)
    k = np.ascontiguousarray(k, dtype=np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    if slot.mode == "decode":
        if t != 1:
            raise ValueError(f"layer {layer}: a decode step takes one token per sequence, received {t}")
        with beside_blas(slot.kernels):
            res = cache.decode(layer, k, v, q4, _attend_config(scale, heads // hkv))
        if isinstance(res, Fused):
            out = to_numpy(res.output)
        else:
            r = res.result
            out = attend_one(
                np, q4, to_numpy(r.k), to_numpy(r.v), None if r.logit_bias is None else to_numpy(r.logit_bias), scale
            )
    else:
        r = cache.prefill(layer, k, v, q4)
        out = attend_chunk(
            np,
            q4,
            to_numpy(r.k),
            to_numpy(r.v),
            None if r.logit_bias is None else to_numpy(r.logit_bias),
            scale,
            in_place=True,
        )
    return np.ascontiguousarray(out, dtype=np.float32).reshape(q.shape)


@functools.cache
def _runtime() -> tuple:
    """What a node call uses, imported once (NumPy, Numba's thread policy, the attention functions)."""
    import numpy as np

    from ..._compat import to_numpy
    from ...ops.numba.threads import beside_blas
    from ...protocol import Fused
    from ..common.layer_attention import attend_chunk, attend_one

    return np, to_numpy, beside_blas, Fused, attend_chunk, attend_one


@functools.lru_cache(maxsize=256)
def _attend_config(scale: float, groups: int) -> Any:
    """The (checked, frozen) ``AttendConfig`` of a node's geometry, made once instead of every call."""
    from ...protocol import AttendConfig

    return AttendConfig(softmax_scale=scale, n_kv_groups=groups)


def run_prompt(
    run: Callable[[Any, Any], Any],
    ids: Any,
    cache: Any,
    num_layers: int,
    *,
    chunk_size: int | None = None,
    prompt_store: str = "exact",
    logits: str = "all",
) -> Any:
    """A prompt through the graph in chunks, stored as the NumPy decoder stores it.

    With ``prompt_store="exact"`` and more than one chunk, the nodes read a
    :class:`~arraykv.integrations.common.prompt_stage.PromptStage` instead of ``cache`` while the
    chunks run: the layers whose cache compresses hold the prompt's keys and values exactly
    (float16) and every chunk attends over them, and when the last chunk is done each such
    layer stores the whole prompt with one ``append`` (calibrated on, and encoding, the exact
    keys and values of the whole prompt). This is what
    :meth:`DecoderModel.prefill <arraykv.integrations.decoder.model.DecoderModel.prefill>` does, so
    the two engines store the same prompt the same way. ``"chunks"`` stores each chunk as it
    comes; the later chunks then attend over the stored (compressed) form of the earlier ones.

    Parameters
    ----------
    run : callable
        ``run(chunk_ids, target)`` runs the graph on ``chunk_ids`` (batch, c) after the tokens
        ``target`` holds, its nodes storing into and attending from ``target`` (``cache`` or the
        stage), and returns the logits (batch, c, vocab).
    ids : numpy.ndarray of int, shape (batch, tokens)
    cache : CompressedKVCache
        Continued from the length of its layer 0; holds the prompt afterwards.
    num_layers : int
        Layers of the graph.
    chunk_size : int, optional
        Tokens per graph run (None: one run).
    prompt_store : {"exact", "chunks"}, default "exact"
    logits : {"all", "last"}, default "all"
        "all": every position's logits, (batch, tokens, vocab); "last": the last position's,
        (batch, vocab).

    Returns
    -------
    numpy.ndarray, float32

    Notes
    -----
    Memory while the prompt runs: the float16 keys and values of the staged layers (SmolLM2 at
    8k tokens: 189 MB, against the 49 MB pqo4 holds afterwards), freed at the end. The prompt is
    stored all or nothing: if a chunk or the final stores fail, ``cache`` is left as it was
    (:func:`~arraykv.integrations.common.generation.undo_on_failure`).
    """
    import numpy as np

    from ..common.generation import cache_length, check_chunk, undo_on_failure
    from ..common.prompt_stage import PromptStage, stages_layer

    check_chunk("chunk_size", chunk_size)
    if not isinstance(prompt_store, str) or prompt_store not in ("exact", "chunks"):
        raise ValueError(f"prompt_store must be 'exact' or 'chunks', received {prompt_store!r}")
    if not isinstance(logits, str) or logits not in ("all", "last"):
        raise ValueError(f"logits must be 'all' or 'last', received {logits!r}")
    t = int(ids.shape[1])
    step = t if chunk_size is None else chunk_size
    start = cache_length(cache, num_layers)
    stage = None
    if prompt_store == "exact" and t > step and any(stages_layer(cache, i) for i in range(num_layers)):
        stage = PromptStage(cache, num_layers, t)
    target = cache if stage is None else stage
    parts = []
    with undo_on_failure(cache, start):
        for s in range(0, t, step):
            out = run(ids[:, s : s + step], target)
            if logits == "all":
                parts.append(out)
            elif s + step >= t:
                parts.append(out[:, -1, :])
        if stage is not None:
            stage.commit()
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)


def custom_op_api() -> Any:
    """``onnxruntime_extensions._ocos``: the package's custom-operator API, without the rest of it.

    Importing ``onnxruntime_extensions`` itself runs its ``__init__``, which imports torch and
    transformers when they are installed (for its tokenizer converters) and sets
    ``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` in the process's environment, which every
    child process then inherits. Measured here (0.15.2, with torch 2.14 and transformers 5.24
    installed): the import took the process from 47 to 570 MiB resident. The operator needs only
    ``_ocos`` (``Opdef``, ``PyCustomOpDef``, ``get_library_path``), so unless the package is
    already imported, that module is imported under a bare stand-in for its package, which is
    removed again: a later ``import onnxruntime_extensions`` runs the package as usual and finds
    the same ``_ocos``.

    Raises
    ------
    ImportError
        ``onnxruntime-extensions`` is not installed (with the extra that installs it).
    """
    name = "onnxruntime_extensions"
    if name in sys.modules or f"{name}._ocos" in sys.modules:
        return require(f"{name}._ocos", "onnx")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return require(f"{name}._ocos", "onnx")  # raises with the install hint
    stand_in = types.ModuleType(name)
    stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = stand_in
    try:
        return importlib.import_module(f"{name}._ocos")
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]


def ensure_registered() -> None:
    """Define the ``ArrayKVAttention`` operator for ``onnxruntime-extensions`` (once per process).

    Raises
    ------
    ImportError
        ``onnxruntime-extensions`` is not installed (with the extra that installs it).
    """
    ox = custom_op_api()
    with _LOCK:
        if _REGISTERED[0]:
            return
        from .graph_rewrite import CACHE_OP

        P = ox.PyCustomOpDef

        def _arraykv_attention(q: Any, k: Any, v: Any, **attrs: Any) -> Any:
            return _node(q, k, v, attrs["handle"], int(attrs["layer"]), float(attrs["scale"]))

        opdef = ox.Opdef.declare(
            op_type=CACHE_OP,
            inputs=[P.dt_float, P.dt_float, P.dt_float],
            outputs=[P.dt_float],
            attrs={"handle": P.dt_string, "layer": P.dt_int64, "scale": P.dt_float},
        )(_arraykv_attention)
        _install_invoker(ox, id(opdef))  # the extensions package keys its operators by id(opdef)
        _REGISTERED[0] = True


def _node(q: Any, k: Any, v: Any, handle: str, layer: int, scale: float) -> Any:
    """One ``ArrayKVAttention`` node call: the attention output (float32, C order, shape of ``q``).

    An exception escaping a Python operator terminates the process (onnxruntime-extensions
    0.15.2 under onnxruntime 1.32: "terminate called after throwing an instance of
    'pybind11::error_already_set'"), so errors are kept on the slot for the caller to raise
    after the run, the output is NaN, and the later layers of the run store nothing.
    """
    slot = _SLOTS.get(handle)
    if slot is not None and slot.error is None:
        try:
            return attend_from_cache(slot, layer, scale, q, k, v)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, see above (KeyboardInterrupt too)
            slot.error = exc
    np = _runtime()[0]
    return np.full(q.shape, np.nan, dtype=np.float32)


def _install_invoker(ox: Any, op_id: int) -> None:
    """Make ONNX Runtime's calls of the ``ArrayKVAttention`` operator skip the package's list round trip.

    ``onnxruntime-extensions`` calls every Python operator through one function installed with
    ``PyCustomOpDef.install_hooker``. Its own (``_ocos._on_pyop_invocation``) turns the
    operator's answer into a Python list (``rv.flatten().tolist()``), which the C++ side turns
    back into a float64 and then a float32 array before copying it into the output tensor: three
    conversions of every output value, for a 512-token chunk of SmolLM2 295k values per layer.
    The C++ side takes any array (``cast<py::array>``; a float32 one of the declared size is
    copied with one ``memcpy``), so this invoker hands it the C-ordered float32 array the node
    returns, and parses a node's attributes once (the package converts the strings it gets
    every call). Calls of any other Python operator go to the package's own function as before.
    """
    fallback = ox._on_pyop_invocation
    nodes: dict = {}

    def invoke(k_id: int, feed: Any, attributes: Any) -> Any:
        if k_id != op_id:
            return fallback(k_id, feed, attributes)
        key = (attributes["handle"], attributes["layer"], attributes["scale"])
        node = nodes.get(key)
        if node is None:
            node = nodes[key] = (str(key[0]), int(key[1]), float(key[2]))
        out = _node(feed[0], feed[1], feed[2], *node)
        return (k_id, out.shape, out)

    ox.PyCustomOpDef.install_hooker(invoke)


def session_options(options: Any = None) -> Any:
    """``options`` (or new ``onnxruntime.SessionOptions``) with the extensions library registered."""
    ort = require("onnxruntime", "onnx")
    ox = custom_op_api()
    ensure_registered()
    so = options if options is not None else ort.SessionOptions()
    so.register_custom_ops_library(ox.get_library_path())
    return so
