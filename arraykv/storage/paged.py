"""A paged KV cache: fixed-size token blocks in one pool per layer, block tables per sequence."""

from __future__ import annotations

import threading

from .. import _compat
from .._types import Array, Namespace
from .._validation import array_namespace, check_bool, check_finite, check_int, dtype_name, is_floating
from .sequences import SequenceIds, check_truncate_length, fork_store

__all__ = ["PagedKVCache"]


class _Layer:
    """Pools and bookkeeping of one layer (guarded by its lock)."""

    def __init__(self) -> None:
        self.k_pool: Array = None
        self.v_pool: Array = None
        self.xp: Namespace = None
        self.free: list[int] = []
        self.tables: dict[int, list[int]] = {}  # seq_id -> list of block ids
        self.lengths: dict[int, int] = {}  # seq_id -> tokens

    def copy(self) -> _Layer:
        out = _Layer()
        if self.k_pool is not None:
            out.k_pool = self.xp.asarray(self.k_pool, copy=True)
            out.v_pool = self.xp.asarray(self.v_pool, copy=True)
        out.xp = self.xp
        out.free = list(self.free)
        out.tables = {s: list(t) for s, t in self.tables.items()}
        out.lengths = dict(self.lengths)
        return out


class PagedKVCache:
    """Keys and values of many sequences in fixed-size blocks (paged attention layout).

    Each layer owns one K pool and one V pool of shape
    ``(num_blocks, num_kv_heads, block_size, head_dim)``, allocated on the first append to
    that layer in the namespace, device and dtype of the appended arrays. A sequence holds a
    block table per layer: its token ``i`` lives in block ``table[i // block_size]`` at slot
    ``i % block_size``. Blocks return to the layer's free list when the sequence is freed.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Layers, KV heads per layer and channels per key head.
    block_size : int, default 16
        Tokens per block.
    num_blocks : int, default 256
        Blocks per layer pool.
    v_head_dim : int, optional
        Channels of the values (default ``head_dim``).
    check_finite : bool, default True
        Reject NaN/Inf keys and values.

    Notes
    -----
    Appends are atomic: the blocks needed are counted before anything is written, and an
    append that does not fit raises ``ValueError`` leaving the cache unchanged. Every method
    is thread-safe: one lock per layer, plus one for the set of live sequence ids (always
    taken after a layer lock, never before).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        num_blocks: int = 256,
        v_head_dim: int | None = None,
        check_finite: bool = True,
    ):
        self.num_layers = check_int("num_layers", num_layers, low=1)
        self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, low=1)
        self.head_dim = check_int("head_dim", head_dim, low=1)
        self.v_head_dim = self.head_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, low=1)
        self.block_size = check_int("block_size", block_size, low=1)
        self.num_blocks = check_int("num_blocks", num_blocks, low=1)
        self.check_finite = check_bool("check_finite", check_finite)
        self._layers = [_Layer() for _ in range(self.num_layers)]
        for lay in self._layers:
            lay.free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._locks = [threading.Lock() for _ in range(self.num_layers)]
        self._ids = SequenceIds()

    # -- sequences ------------------------------------------------------------------
    def allocate_sequence(self) -> int:
        """Register a new, empty sequence and return its id (ids are never reused).

        Returns
        -------
        int
            The new sequence's id.
        """
        return self._ids.allocate()

    def sequences(self) -> list[int]:
        """Ids of the live sequences, ascending.

        Returns
        -------
        list of int
            The ids allocated and not freed.
        """
        return self._ids.live()

    def _check_seq(self, seq_id: int) -> int:
        return self._ids.check(seq_id)

    def _check_layer(self, layer: int) -> int:
        return check_int("layer", layer, low=0, high=self.num_layers - 1)

    def free(self, seq_id: int) -> None:
        """Return every block of ``seq_id`` to the pools; freeing twice is an error.

        Parameters
        ----------
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        """
        sid = self._ids.release(seq_id)
        for i, lay in enumerate(self._layers):
            with self._locks[i]:
                blocks = lay.tables.pop(sid, [])
                lay.lengths.pop(sid, None)
                lay.free.extend(reversed(blocks))

    # -- tokens ---------------------------------------------------------------------
    def append(self, layer: int, seq_id: int, k: Array, v: Array) -> None:
        """Append tokens to one sequence of one layer.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        k : array, shape (num_kv_heads, new_tokens, head_dim)
            Keys of the new tokens, floating; the layer's pool takes the namespace, device and
            dtype of its first append.
        v : array, shape (num_kv_heads, new_tokens, v_head_dim)
            Values of the new tokens, in the dtype of ``k``.

        Raises
        ------
        ValueError
            Out of blocks (nothing is written), unknown or freed ``seq_id``, bad shapes.
        TypeError
            Non-floating dtypes, or a namespace/dtype unlike the layer's pool.
        """
        layer = self._check_layer(layer)
        xp, t = self._check_tokens(k, v)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            lay = self._layers[layer]
            if lay.k_pool is not None:
                if lay.xp is not xp:
                    raise TypeError(f"layer {layer} pools hold arrays of another library")
                if lay.k_pool.dtype != k.dtype:
                    raise TypeError(
                        f"k must have dtype {dtype_name(lay.k_pool.dtype)} like layer {layer}'s pool, "
                        f"received {dtype_name(k.dtype)}"
                    )
                if _compat.device(lay.k_pool) != _compat.device(k):
                    raise ValueError(f"k must be on device {_compat.device(lay.k_pool)}, received {_compat.device(k)}")
            length = lay.lengths.get(sid, 0)
            table = lay.tables.get(sid, [])
            bs = self.block_size
            need = -(-(length + t) // bs) - len(table)
            if need > len(lay.free):
                raise ValueError(
                    f"layer {layer} has {len(lay.free)} free blocks of {bs} tokens and seq_id {sid} needs {need} more "
                    f"for {t} tokens; nothing was written (free sequences or raise num_blocks)"
                )
            if lay.k_pool is None:
                dev = _compat.device(k)
                lay.k_pool = xp.zeros(
                    (self.num_blocks, self.num_kv_heads, bs, self.head_dim), dtype=k.dtype, device=dev
                )
                lay.v_pool = xp.zeros(
                    (self.num_blocks, self.num_kv_heads, bs, self.v_head_dim), dtype=k.dtype, device=dev
                )
                lay.xp = xp
            new_blocks = [lay.free.pop() for _ in range(need)]
            table = table + new_blocks
            pos, src = length, 0
            while src < t:
                blk, off = table[pos // bs], pos % bs
                n = min(bs - off, t - src)
                lay.k_pool[blk, :, off : off + n, :] = k[:, src : src + n, :]
                lay.v_pool[blk, :, off : off + n, :] = v[:, src : src + n, :]
                pos += n
                src += n
            lay.tables[sid] = table
            lay.lengths[sid] = length + t

    def fork(self) -> PagedKVCache:
        """An independent copy: the same sequences (same ids), blocks and free lists.

        A full copy of every layer's pools (O(``reserved_bytes()``), under every layer lock);
        writes to either never affect the other.

        Returns
        -------
        PagedKVCache
            The copy.
        """
        return fork_store(self, "_layers", _Layer.copy)

    def truncate(self, layer: int, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id`` in ``layer``; blocks no longer used go back to the pool.

        Afterwards the sequence is as if the later tokens had never been appended: same
        ``seq_len``, ``get_kv`` and ``memory_usage`` (the blocks past ``ceil(length /
        block_size)`` are freed; the next append reuses the first of them first). ``length``
        may be 0 (the sequence stays allocated, holding nothing in this layer).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        length : int
            Tokens kept, ``0 <= length <= seq_len(layer, seq_id)``.

        Raises
        ------
        TypeError
            ``layer``, ``seq_id`` or ``length`` not an int.
        ValueError
            Out of range (``0 <= length <= seq_len``), or ``seq_id`` not live; nothing changes.
        """
        layer = self._check_layer(layer)
        length = check_int("length", length, low=0)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            lay = self._layers[layer]
            held = lay.lengths.get(sid, 0)
            check_truncate_length(length, held, sid, layer)
            table = lay.tables.get(sid, [])
            keep = -(-length // self.block_size)
            lay.free.extend(reversed(table[keep:]))
            if length:
                lay.tables[sid], lay.lengths[sid] = table[:keep], length
            else:
                lay.tables.pop(sid, None)
                lay.lengths.pop(sid, None)

    def _check_tokens(self, k: Array, v: Array) -> tuple[Namespace, int]:
        xp = array_namespace(k=k, v=v)
        for name, x, d in (("k", k, self.head_dim), ("v", v, self.v_head_dim)):
            if x.ndim != 3:
                raise ValueError(
                    f"{name} must have shape (num_kv_heads, new_tokens, head_dim), received shape {tuple(x.shape)}"
                )
            if not is_floating(xp, x.dtype):
                raise TypeError(f"{name} must have a floating dtype, received {dtype_name(x.dtype)}")
            if int(x.shape[0]) != self.num_kv_heads:
                raise ValueError(f"{name} must have {self.num_kv_heads} heads (axis 0), received {int(x.shape[0])}")
            if int(x.shape[2]) != d:
                raise ValueError(f"{name} must have {d} channels (axis 2), received {int(x.shape[2])}")
        if int(k.shape[1]) != int(v.shape[1]):
            raise ValueError(
                f"k and v must hold the same tokens (axis 1), received {int(k.shape[1])} and {int(v.shape[1])}"
            )
        if int(k.shape[1]) < 1:
            raise ValueError("k must hold at least one token (axis 1), received 0")
        if k.dtype != v.dtype:
            raise TypeError(f"k and v must share one dtype, received {dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
        if self.check_finite:
            check_finite(xp, k=k, v=v)
        return xp, int(k.shape[1])

    def get_kv(self, layer: int, seq_id: int) -> tuple[Array, Array]:
        """Keys and values of ``seq_id`` in ``layer``: two arrays (heads, seq_len, dim), copies.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).

        Returns
        -------
        k : array, shape (num_kv_heads, seq_len, head_dim)
            The keys, in the pool's namespace and dtype.
        v : array, shape (num_kv_heads, seq_len, v_head_dim)
            The values.

        Raises
        ------
        ValueError
            The sequence holds no token in this layer (the pool's dtype may not even be known
            yet).
        """
        layer = self._check_layer(layer)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            lay = self._layers[layer]
            length = lay.lengths.get(sid, 0)
            if length == 0:
                raise ValueError(f"seq_id {sid} holds no tokens in layer {layer}")
            return self._gather(lay, lay.tables[sid], length)

    def _gather(self, lay: _Layer, table: list[int], length: int) -> tuple[Array, Array]:
        xp = lay.xp
        ids = xp.asarray(table, dtype=xp.int64, device=_compat.device(lay.k_pool))
        out = []
        for pool in (lay.k_pool, lay.v_pool):
            blocks = xp.take(pool, ids, axis=0)  # (nb, heads, bs, d)
            nb, h, bs, d = (int(s) for s in blocks.shape)
            seq = xp.reshape(xp.permute_dims(blocks, (1, 0, 2, 3)), (h, nb * bs, d))
            out.append(seq[:, :length, :])
        return out[0], out[1]

    def get_batch(self, layer: int, seq_ids: list[int]) -> tuple[Array, Array, list[int]]:
        """Sequences of different lengths as one zero-padded batch.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_ids : list of int
            Live sequences, each holding at least one token in ``layer``; at least one.

        Returns
        -------
        k : array (len(seq_ids), heads, max_len, head_dim)
            Keys, row ``i`` those of ``seq_ids[i]``, zero past its length.
        v : array (len(seq_ids), heads, max_len, v_head_dim)
            Values, zero-padded the same way.
        lengths : list of int
            Tokens of each sequence; ``max_len`` is the largest.
        """
        layer = self._check_layer(layer)
        if not seq_ids:
            raise ValueError("seq_ids must name at least one sequence, received none")
        with self._locks[layer]:
            sids = [self._check_seq(s) for s in seq_ids]
            lay = self._layers[layer]
            lengths = [lay.lengths.get(s, 0) for s in sids]
            if min(lengths) == 0:
                raise ValueError(f"seq_id {sids[lengths.index(0)]} holds no tokens in layer {layer}")
            xp = lay.xp
            top = max(lengths)
            ks, vs = [], []
            for s, n in zip(sids, lengths):
                k, v = self._gather(lay, lay.tables[s], n)
                if n < top:
                    dev = _compat.device(k)
                    k = xp.concat(
                        [k, xp.zeros((self.num_kv_heads, top - n, self.head_dim), dtype=k.dtype, device=dev)], axis=1
                    )
                    v = xp.concat(
                        [v, xp.zeros((self.num_kv_heads, top - n, self.v_head_dim), dtype=v.dtype, device=dev)], axis=1
                    )
                ks.append(k)
                vs.append(v)
            return xp.stack(ks, axis=0), xp.stack(vs, axis=0), lengths

    def seq_len(self, layer: int, seq_id: int) -> int:
        """Tokens of ``seq_id`` in ``layer``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).

        Returns
        -------
        int
            Tokens held, 0 when none were appended to this layer.
        """
        layer = self._check_layer(layer)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            return self._layers[layer].lengths.get(sid, 0)

    def block_table(self, layer: int, seq_id: int) -> list[int]:
        """Block ids of ``seq_id`` in ``layer``, in token order (a copy).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).

        Returns
        -------
        list of int
            Indices into the layer's pools along axis 0; token ``i`` is in block
            ``table[i // block_size]``.
        """
        layer = self._check_layer(layer)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            return list(self._layers[layer].tables.get(sid, []))

    def free_blocks(self, layer: int) -> int:
        """Blocks of ``layer`` not held by any sequence.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        int
            Free blocks, ``0 .. num_blocks``.
        """
        layer = self._check_layer(layer)
        with self._locks[layer]:
            return len(self._layers[layer].free)

    def memory_usage(self) -> int:
        """Bytes of the blocks held by sequences (K and V), over all layers.

        Returns
        -------
        int
            Whole blocks counted, 0 before the first append.
        """
        total = 0
        for i, lay in enumerate(self._layers):
            with self._locks[i]:
                if lay.k_pool is None:
                    continue
                used = self.num_blocks - len(lay.free)
                total += used * (_compat.array_nbytes(lay.k_pool) + _compat.array_nbytes(lay.v_pool)) // self.num_blocks
        return total

    def reserved_bytes(self) -> int:
        """Bytes of the allocated pools.

        Returns
        -------
        int
            K and V pools of every layer allocated so far (a layer's on its first append).
        """
        total = 0
        for i, lay in enumerate(self._layers):
            with self._locks[i]:
                if lay.k_pool is not None:
                    total += _compat.array_nbytes(lay.k_pool) + _compat.array_nbytes(lay.v_pool)
        return total

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, block_size={self.block_size}, num_blocks={self.num_blocks})"
        )
