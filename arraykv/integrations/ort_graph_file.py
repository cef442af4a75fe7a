"""Open a rewritten ONNX graph from a file whose weights are the original's, not from bytes.

ONNX Runtime given a model as serialized bytes keeps its own copy of every weight in the
process; given a path whose weights are external data files, it reads them from there and the
model's bytes never pass through Python. Measured on this project's SmolLM2 export (a 125 kB
graph and a 653 MB ``.data`` file, onnxruntime 1.32, CPU; torch imported in both cases): a
session opened from the file left the process at 1.10 GiB, the same graph rewritten in Python
and opened from bytes at 2.85 GiB (3.7 GiB at the peak); the rewritten graph written beside the
original weights and opened by path again at 1.10 GiB.

:func:`rewritten_session` does the latter for any input:

- a path whose weights are external data: the graph is loaded **without** them (small
  initializers, which a rewriter may read to fold a softmax scale, are loaded), rewritten, and
  written into the model's own folder under a hidden unique name, so the new graph reads the
  original weights (ONNX Runtime refuses external data outside the graph's folder, symbolic
  links resolved); only the graph is written there;
- a path whose weights are inside the file, bytes or an ``onnx.ModelProto``: the rewritten
  graph and its weights are written into a temporary folder (not beside the model: an
  interrupted process would leave a copy of the weights there).

Where the model's folder cannot be written, or ``work_dir`` names another folder, the graph goes
into a temporary folder there and the original data files are hard-linked into it (copied
where a link cannot be made: another file system). What was written is removed once the session
is open (ONNX Runtime has read what it needs; a file it maps stays valid after its name is
removed, on the systems that allow removing it).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .ort_graph import load_model_proto

__all__ = ["load_graph", "write_graph", "rewritten_session", "SMALL_INITIALIZER"]

#: Initializers of at most this many elements are loaded even when the graph's weights stay on
#: disk: softmax scales and shape constants a rewriter evaluates are this small.
SMALL_INITIALIZER = 64


def load_graph(model: Any) -> tuple:
    """``model`` as an ``onnx.ModelProto``, with the weights of a file left on disk.

    Parameters
    ----------
    model : str, PathLike, bytes or onnx.ModelProto

    Returns
    -------
    proto : onnx.ModelProto
        For a path: external initializers of more than :data:`SMALL_INITIALIZER` elements are
        not loaded (they keep their ``external_data`` entries); weights stored in the file itself
        are. For bytes or a proto: the whole model (a proto is returned as given).
    base_dir : str or None
        The folder the external data locations are relative to (None for bytes or a proto).
    """
    import onnx
    from onnx import external_data_helper

    if isinstance(model, (onnx.ModelProto, bytes, bytearray, memoryview)):
        return load_model_proto(model), None
    path = os.fspath(model)
    proto = onnx.load(path, load_external_data=False)
    base = os.path.dirname(os.path.abspath(path))
    for tensor in _all_tensors(proto.graph):
        if external_data_helper.uses_external_data(tensor) and _elements(tensor) <= SMALL_INITIALIZER:
            external_data_helper.load_external_data_for_tensor(tensor, base)
    return proto, base


def _all_tensors(graph: Any) -> Iterator[Any]:
    """Every tensor ``graph`` holds: initializers and tensor attributes, subgraphs included."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def _elements(tensor: Any) -> int:
    n = 1
    for d in tensor.dims:
        n *= int(d)
    return n


def _external_locations(proto: Any) -> set:
    from onnx import external_data_helper

    found = set()
    for tensor in _all_tensors(proto.graph):
        if external_data_helper.uses_external_data(tensor):
            info = external_data_helper.ExternalDataInfo(tensor)
            found.add(info.location)
    return found


def _link(target: str, name: str) -> None:
    """``name`` refers to the file ``target``: a hard link, else a copy (another file system)."""
    os.makedirs(os.path.dirname(name), exist_ok=True)
    try:
        os.link(target, name)
    except OSError:
        shutil.copyfile(target, name)


def _checked_location(location: str) -> str:
    norm = os.path.normpath(location)
    if os.path.isabs(norm) or norm.split(os.sep)[0] == os.pardir:
        raise ValueError(f"external data location {location!r} is not inside the model's folder")
    return norm


def write_graph(graph: Any, folder: str, stem: str) -> list:
    """Write ``graph`` as ``folder/stem`` with its in-memory weights over 1 kB in ``folder/stem.data``.

    Parameters
    ----------
    graph : onnx.ModelProto
        External-data initializers keep their locations (relative to ``folder``).
    folder, stem : str

    Returns
    -------
    list of str
        The files written, the graph first.
    """
    import onnx

    path = os.path.join(folder, stem)
    data = stem + ".data"
    onnx.save_model(
        graph, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data, size_threshold=1024
    )
    written = [path]
    if os.path.exists(os.path.join(folder, data)):
        written.append(os.path.join(folder, data))
    return written


def rewritten_session(
    model: Any,
    rewrite: Callable[[Any], tuple],
    options: Any,
    providers: Sequence[str],
    *,
    work_dir: str | None = None,
) -> tuple:
    """An ONNX Runtime session of ``rewrite(model)``, opened from a file on the original weights.

    Parameters
    ----------
    model : str, PathLike, bytes or onnx.ModelProto
    rewrite : callable
        ``rewrite(proto) -> (rewritten proto, info)``; must not need the values of initializers
        of more than :data:`SMALL_INITIALIZER` elements. A rewritten proto of None opens the
        model as it was given.
    options : onnxruntime.SessionOptions
    providers : sequence of str
    work_dir : str, optional
        A folder to write the rewritten graph in instead of the model's own (module notes):
        the original data files are then linked, or copied, into a temporary folder there.

    Returns
    -------
    session : onnxruntime.InferenceSession
    proto : onnx.ModelProto
        The model as loaded (weights on disk where they were), for what the caller reads of it.
    base_dir : str or None
        The folder ``proto``'s external data locations are relative to (:func:`load_graph`).
    info
        What ``rewrite`` returned beside the graph.

    Raises
    ------
    ValueError
        An external data location is absolute or leaves the model's folder.
    """
    import onnxruntime as ort

    proto, base = load_graph(model)
    graph, info = rewrite(proto)
    if graph is None:  # the model as given: its file, its bytes, or the proto's
        source = os.fspath(model) if base is not None else model
        if not isinstance(source, (str, bytes)):
            source = proto.SerializeToString()
        return ort.InferenceSession(source, options, providers=list(providers)), proto, base, info
    locations = sorted(_checked_location(loc) for loc in _external_locations(graph))
    if locations and base is None:
        raise ValueError(f"the graph refers to external data {locations[0]!r} but was not given as a file")
    stem = f".arraykv-{uuid.uuid4().hex}.onnx"
    written: list = []
    folder = None
    try:
        if locations and work_dir is None and os.access(str(base), os.W_OK):
            written = write_graph(graph, str(base), stem)  # the graph alone, beside its weights
        else:
            folder = tempfile.mkdtemp(prefix="arraykv-graph-", dir=work_dir)
            for location in locations:
                _link(os.path.join(str(base), location), os.path.join(folder, location))
            written = write_graph(graph, folder, stem)
        del graph  # written out; the session reads the weights from the files
        session = ort.InferenceSession(written[0], options, providers=list(providers))
    finally:
        for path in written:
            try:
                os.remove(path)
            except OSError:
                pass
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return session, proto, base, info
