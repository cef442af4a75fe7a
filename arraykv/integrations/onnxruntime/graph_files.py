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
  written under a hidden name into the folder its data files really are in (symbolic links
  resolved: in huggingface_hub's cache, ``blobs/``, its locations rewritten to the files'
  names there), so the new graph reads the original weights; only the graph is written there.
  External data is taken from where ONNX Runtime takes it (:func:`resolve_data`);
- a path whose weights are inside the file, bytes or an ``onnx.ModelProto``: the rewritten
  graph and its weights are written into a temporary folder (not beside the model).

Where the graph cannot be written beside the weights (no room, no permission), or ``work_dir``
names another folder, it goes into a temporary folder (in ``work_dir``, else the system's) with
the data files, links resolved, hard-linked into it (copied where a link cannot be made: another
file system). Where that fails too, one ``OSError`` names every place tried.

What was written is removed once the session is open (ONNX Runtime has read what it needs; a
file it maps stays valid after its name is removed, on the systems that allow removing it), or
when opening fails in any way (``KeyboardInterrupt`` included): every path is recorded before
it is made. A process killed in between cannot remove its files, so their names say which
process wrote them (:mod:`arraykv.integrations.onnxruntime.scratch_files`), and each open first removes the
files and temporary folders of dead owners in the folders it writes to.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .graph_rewrite import load_model_proto
from .scratch_files import owned_name, remove_stale

__all__ = ["load_graph", "resolve_data", "write_graph", "rewritten_session", "SMALL_INITIALIZER"]

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

    Raises
    ------
    ValueError
        A small initializer's data file is outside the model's folders (:func:`resolve_data`) or
        shorter than its offset and length say.
    """
    import onnx
    from onnx import external_data_helper

    if isinstance(model, (onnx.ModelProto, bytes, bytearray, memoryview)):
        return load_model_proto(model), None
    path = os.fspath(model)
    proto = onnx.load(path, load_external_data=False)
    for tensor in _all_tensors(proto.graph):
        if external_data_helper.uses_external_data(tensor) and _elements(tensor) <= SMALL_INITIALIZER:
            _load_small(tensor, path)
    return proto, os.path.dirname(os.path.abspath(path))


def resolve_data(model_path: str, location: str) -> str:
    """The file an external data ``location`` of the model at ``model_path`` names, links resolved.

    ONNX Runtime (1.32) opens external data whose file, symbolic links resolved, lies inside
    the model's folder as named (links resolved) or inside the folder of the model file itself
    (its link resolved). This takes the same files, so that the layouts ONNX Runtime opens
    open here too: huggingface_hub's cache (``snapshots/<rev>/model.onnx`` and its data both
    links into ``blobs/``), a linked model file, a linked folder.

    Parameters
    ----------
    model_path : str
    location : str
        As written in the tensor's ``external_data``.

    Returns
    -------
    str
        The real path of the data file.

    Raises
    ------
    ValueError
        ``location`` is absolute, starts with ``..``, or its file is in neither folder.
    """
    _checked_location(location)
    folder = os.path.dirname(os.path.abspath(model_path))
    real = os.path.realpath(os.path.join(folder, location))
    if not any(_inside(real, root) for root in _data_roots(model_path)):
        raise ValueError(
            f"external data location {location!r} is not inside the model's folder: it resolves to {real!r}"
        )
    return real


def _data_roots(model_path: str) -> list:
    """The folders ONNX Runtime takes external data from (:func:`resolve_data`), links resolved."""
    roots = [os.path.realpath(os.path.dirname(os.path.abspath(model_path)))]
    own = os.path.dirname(os.path.realpath(model_path))
    return roots + ([own] if own != roots[0] else [])


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def _load_small(tensor: Any, model_path: str) -> None:
    """Read ``tensor``'s external data into it (onnx's own reader refuses linked data files)."""
    from onnx import TensorProto, external_data_helper

    info = external_data_helper.ExternalDataInfo(tensor)
    with open(resolve_data(model_path, info.location), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        offset = info.offset or 0
        length = size - offset if info.length is None else info.length
        if offset + length > size:
            raise ValueError(
                f"external data of tensor {tensor.name!r} ({offset} + {length} bytes) runs past the end of "
                f"{info.location!r} ({size} bytes)"
            )
        f.seek(offset)
        tensor.raw_data = f.read(length)
    tensor.data_location = TensorProto.DEFAULT
    del tensor.external_data[:]


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
        An external data location is absolute or its file is outside the model's folders
        (:func:`resolve_data`).
    OSError
        The graph could be written in none of the places tried (no room, no permission): one
        error naming each place and why; nothing written is left behind.
    """
    import onnxruntime as ort

    proto, base = load_graph(model)
    graph, info = rewrite(proto)
    if graph is None:  # the model as given: its file, its bytes, or the proto's
        source = os.fspath(model) if base is not None else model
        if not isinstance(source, (str, bytes)):
            source = proto.SerializeToString()
        return ort.InferenceSession(source, options, providers=list(providers)), proto, base, info
    locations = sorted({_checked_location(loc) for loc in _external_locations(graph)})
    if locations and base is None:
        raise ValueError(f"the graph refers to external data {locations[0]!r} but was not given as a file")
    sources = {loc: resolve_data(os.fspath(model), loc) for loc in locations}
    places = _places(None if base is None else os.fspath(model), sources, work_dir)
    failed: list = []
    for i, (place, temporary) in enumerate(places):
        if temporary:
            remove_stale(place, _FOLDER)
        else:
            remove_stale(place, _HIDDEN, _HIDDEN_SUFFIXES)
        created: list = []
        try:
            try:
                path = _write_at(graph, place, temporary, sources, created, keep=i < len(places) - 1)
            except OSError as e:  # no room, no permission, read-only: the next place
                failed.append((place, temporary, e))
                continue
            del graph  # written out; the session reads the weights from the files
            session = ort.InferenceSession(path, options, providers=list(providers))
        finally:
            _remove(created)
        return session, proto, base, info
    raise _write_error(failed)


_HIDDEN = ".arraykv-"
_HIDDEN_SUFFIXES = (".onnx", ".onnx.data")
_FOLDER = "arraykv-graph-"


def _places(model_path: str | None, sources: dict, work_dir: str | None) -> list:
    """``(folder, temporary)`` to try in turn: beside the weights, then a temporary folder."""
    places = []
    if sources and work_dir is None and model_path is not None:
        for root in _data_roots(model_path):  # the first that holds every data file
            if all(_inside(src, root) for src in sources.values()):
                places.append((root, False))
                break
    places.append((tempfile.gettempdir() if work_dir is None else os.fspath(work_dir), True))
    return places


def _write_at(graph: Any, place: str, temporary: bool, sources: dict, created: list, *, keep: bool) -> str:
    """Write ``graph`` at ``place``; every path is put in ``created`` before it is made.

    Beside the weights, the graph's data locations are rewritten relative to ``place`` (the
    folder its data files really are in); in a temporary folder (made inside ``place``), the
    data files are linked under their own locations. ``keep``: write a copy, leaving ``graph``
    unchanged for another try (saving moves its large tensors out).
    """
    import onnx

    if keep:
        copy = onnx.ModelProto()
        copy.CopyFrom(graph)
        graph = copy
    if temporary:
        folder = os.path.join(place, owned_name(_FOLDER))
        created.append(folder)
        os.mkdir(folder, 0o700)
        for location, src in sources.items():
            _link(src, os.path.join(folder, location))
    else:
        folder = place
        _relocate(graph, {loc: os.path.relpath(src, place) for loc, src in sources.items()})
    stem = owned_name(_HIDDEN, ".onnx")
    target = os.path.join(folder, stem)
    created += [target, target + ".data"]
    write_graph(graph, folder, stem)
    return target


def _relocate(graph: Any, locations: dict) -> None:
    for tensor in _all_tensors(graph.graph):
        for entry in tensor.external_data:
            if entry.key == "location" and os.path.normpath(entry.value) in locations:
                entry.value = locations[os.path.normpath(entry.value)]


def _remove(paths: list) -> None:
    for path in reversed(paths):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass
        except OSError:
            pass  # left for the next open of a later process (scratch_files.remove_stale)


def _write_error(failed: list) -> OSError:
    where = "; ".join(
        f"{'in a temporary folder in' if temporary else 'beside the weights in'} {place!r}: {e}"
        for place, temporary, e in failed
    )
    return OSError(
        failed[-1][2].errno,
        f"could not write the rewritten ONNX graph for ONNX Runtime to open ({where}); make room there, "
        f"or pass work_dir= a folder that has it",
    )
