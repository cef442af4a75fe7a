"""Multi-head latent attention (MLA) cache: one latent vector per token instead of full K/V."""

from __future__ import annotations

import threading

from .. import _compat
from .._types import Array, Namespace
from .._validation import array_namespace, check_bool, check_finite, check_int, dtype_name, is_floating
from .growable import TokenBuffers
from .sequences import SequenceIds, check_truncate_length, fork_store

__all__ = ["MlaCache"]


class _Projection:
    """Up projections (heads, dim, latent) and the down projection (latent, in_dim), float32."""

    def __init__(self, up_k: Array, up_v: Array, down: Array):
        self.up_k = up_k
        self.up_v = up_v
        self.down = down


class MlaCache:
    """Per-token latents ``c`` (``latent_dim``) plus a decoupled RoPE key, as in DeepSeek-V2.

    Keys and values of a token are ``k_nope[h] = W_uk[h] c``, ``v[h] = W_uv[h] c`` and
    ``k[h] = [k_nope[h], k_rope[h]]`` (the RoPE part is the last ``rope_dim`` channels of the
    key). The projections of a layer are either given (:meth:`set_projection`, for a model
    that has MLA weights) or fitted from calibration K/V (:meth:`fit`).

    Parameters
    ----------
    num_layers, num_heads, head_dim : int
        ``head_dim`` counts the RoPE channels of the key.
    latent_dim : int
        Latent size per token.
    rope_dim : int, default 0
        Decoupled RoPE channels at the end of each key, stored exactly.
    v_head_dim : int, optional
        Value channels (default ``head_dim - rope_dim``).
    shared_rope : bool, default False
        Store one RoPE key per token shared by all heads (DeepSeek-V2); :meth:`append` then
        requires the RoPE parts of all heads to be equal.
    check_finite : bool, default True
        Reject NaN/Inf keys and values (:meth:`append`) and latents (:meth:`append_compressed`).

    Notes
    -----
    DeepSeek-V2 (2024) caches ``c_t = W_dkv h_t`` (512 values) and a 64-channel RoPE key
    shared by the heads, instead of ``2 * heads * head_dim`` values; position information
    cannot pass through the latent because RoPE does not commute with the up projection, hence
    the decoupled part. Fitted from K/V, the best linear latent of rank ``latent_dim`` for the
    stacked vector ``z = [k_nope; v]`` of all heads is given by the top right singular vectors
    ``U`` of the calibration matrix (Eckart–Young): down = ``Uᵀ``, up = ``U``. Given only up
    projections, :meth:`append` maps K/V to the least-squares latent with the pseudo-inverse.
    Bytes per token: ``latent_dim + rope_heads * rope_dim`` values.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_heads: int,
        head_dim: int,
        latent_dim: int,
        rope_dim: int = 0,
        v_head_dim: int | None = None,
        shared_rope: bool = False,
        check_finite: bool = True,
    ):
        self.num_layers = check_int("num_layers", num_layers, low=1)
        self.num_heads = check_int("num_heads", num_heads, low=1)
        self.head_dim = check_int("head_dim", head_dim, low=1)
        self.rope_dim = check_int("rope_dim", rope_dim, low=0, high=self.head_dim - 1)
        self.nope_dim = self.head_dim - self.rope_dim
        self.v_head_dim = self.nope_dim if v_head_dim is None else check_int("v_head_dim", v_head_dim, low=1)
        self.in_dim = self.num_heads * (self.nope_dim + self.v_head_dim)
        self.latent_dim = check_int("latent_dim", latent_dim, low=1, high=self.in_dim)
        shared_rope = check_bool("shared_rope", shared_rope)
        check_finite = check_bool("check_finite", check_finite)
        self.shared_rope = shared_rope
        self.rope_heads = 1 if shared_rope else self.num_heads
        self.check_finite = check_finite
        self._proj: list[_Projection | None] = [None] * self.num_layers
        self._data: list[dict[int, TokenBuffers]] = [dict() for _ in range(self.num_layers)]  # seq_id -> TokenBuffers
        self._locks = [threading.Lock() for _ in range(self.num_layers)]
        self._ids = SequenceIds()

    # -- projections ----------------------------------------------------------------
    def set_projection(self, layer: int, up_k: Array, up_v: Array, down: Array | None = None) -> None:
        """Use given MLA weights for ``layer``.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        up_k : array (num_heads, head_dim - rope_dim, latent_dim)
            Up projection of the keys' non-RoPE channels, ``k_nope[h] = up_k[h] @ c``; floating,
            held as float32.
        up_v : array (num_heads, v_head_dim, latent_dim)
            Up projection of the values, ``v[h] = up_v[h] @ c``; floating, held as float32.
        down : array (latent_dim, num_heads * (head_dim - rope_dim + v_head_dim)), optional
            Maps stacked ``[k_nope of every head, v of every head]`` to a latent; default is
            the pseudo-inverse of the stacked up projections (least squares).

        Raises
        ------
        ValueError
            ``layer`` holds latents of some sequence: they were encoded with the current
            projections and would silently decode differently under new ones. Call
            :meth:`reset_layer` first (it forgets those tokens), then append them again.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        xp = _compat.namespace(up_k, up_v)
        for name, w, shape in (
            ("up_k", up_k, (self.num_heads, self.nope_dim, self.latent_dim)),
            ("up_v", up_v, (self.num_heads, self.v_head_dim, self.latent_dim)),
        ):
            if tuple(int(s) for s in w.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, received {tuple(w.shape)}")
            if not is_floating(xp, w.dtype):
                raise TypeError(f"{name} must have a floating dtype, received {dtype_name(w.dtype)}")
        up_k = xp.astype(up_k, xp.float32)
        up_v = xp.astype(up_v, xp.float32)
        check_finite(xp, up_k=up_k, up_v=up_v)
        up = self._stack_up(xp, up_k, up_v)  # (in_dim, latent)
        if down is None:
            down = xp.astype(xp.linalg.pinv(xp.astype(up, xp.float64)), xp.float32)
        else:
            if tuple(int(s) for s in down.shape) != (self.latent_dim, self.in_dim):
                raise ValueError(f"down must have shape {(self.latent_dim, self.in_dim)}, received {tuple(down.shape)}")
            down = xp.astype(down, xp.float32)
            check_finite(xp, down=down)
        with self._locks[layer]:
            self._refuse_if_holding(layer, "set_projection")
            self._proj[layer] = _Projection(up_k, up_v, down)

    def fit(self, layer: int, k: Array, v: Array) -> None:
        """Fit the projections of ``layer`` from calibration keys and values by SVD.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        k : array (num_heads, n, head_dim)
            Calibration keys (the RoPE channels take no part in the fit).
        v : array (num_heads, n, v_head_dim)
            Calibration values; ``n >= 1`` calibration tokens, in the dtype of ``k``.

        Raises
        ------
        ValueError
            ``layer`` holds latents (see :meth:`set_projection`); call :meth:`reset_layer` first.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        xp, _ = self._check_kv(k, v)
        z = self._stack_tokens(xp, xp.astype(k, xp.float32), xp.astype(v, xp.float32))  # (n, in_dim)
        z64 = xp.astype(z, xp.float64)
        gram = xp.matmul(xp.matrix_transpose(z64), z64)
        _, vecs = xp.linalg.eigh(gram)
        u = xp.astype(xp.flip(vecs, axis=-1)[:, : self.latent_dim], xp.float32)  # (in_dim, latent)
        hn = self.num_heads * self.nope_dim
        up_k = xp.reshape(u[:hn, :], (self.num_heads, self.nope_dim, self.latent_dim))
        up_v = xp.reshape(u[hn:, :], (self.num_heads, self.v_head_dim, self.latent_dim))
        with self._locks[layer]:
            self._refuse_if_holding(layer, "fit")
            self._proj[layer] = _Projection(up_k, up_v, xp.matrix_transpose(u))

    def _refuse_if_holding(self, layer: int, what: str) -> None:
        """Raise ``ValueError`` if ``layer`` (whose lock the caller holds) holds any token."""
        held = sorted(sid for sid, buf in self._data[layer].items() if buf.length)
        if held:
            raise ValueError(
                f"{what}() would change how the latents already stored in layer {layer} "
                f"(seq_ids {held}) decode; call reset_layer({layer}) first, then append them again"
            )

    def reset_layer(self, layer: int) -> None:
        """Forget the tokens of every sequence in ``layer``; its projections and the sequence ids stay.

        After it, :meth:`set_projection` and :meth:`fit` may replace the layer's projections.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        with self._locks[layer]:
            self._data[layer] = {}

    def projection(self, layer: int) -> tuple[Array, Array, Array] | None:
        """``(up_k, up_v, down)`` of ``layer`` (None when not set).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.

        Returns
        -------
        tuple of array or None
            The float32 projections as :meth:`set_projection` takes them (the arrays held, not
            copies); None when the layer has none yet.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        p = self._proj[layer]
        return None if p is None else (p.up_k, p.up_v, p.down)

    def _stack_up(self, xp: Namespace, up_k: Array, up_v: Array) -> Array:
        return xp.concat([xp.reshape(up_k, (-1, self.latent_dim)), xp.reshape(up_v, (-1, self.latent_dim))], axis=0)

    def _stack_tokens(self, xp: Namespace, k32: Array, v32: Array) -> Array:
        """(heads, t, head_dim), (heads, t, dv) → (t, in_dim) = [k_nope of every head, v of every head]."""
        t = int(k32.shape[1])
        kn = xp.reshape(xp.permute_dims(k32[:, :, : self.nope_dim], (1, 0, 2)), (t, -1))
        vv = xp.reshape(xp.permute_dims(v32, (1, 0, 2)), (t, -1))
        return xp.concat([kn, vv], axis=1)

    # -- sequences ------------------------------------------------------------------
    def allocate_sequence(self) -> int:
        """Register a new, empty sequence and return its id (ids are never reused).

        Returns
        -------
        int
            The new sequence's id.
        """
        return self._ids.allocate()

    def free(self, seq_id: int) -> None:
        """Forget ``seq_id`` in every layer; freeing twice is an error.

        Parameters
        ----------
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        """
        sid = self._ids.release(seq_id)
        for i in range(self.num_layers):
            with self._locks[i]:
                self._data[i].pop(sid, None)

    def _check_seq(self, seq_id: int) -> int:
        return self._ids.check(seq_id)

    def _check_kv(self, k: Array, v: Array) -> tuple[Namespace, int]:
        xp = array_namespace(k=k, v=v)
        for name, x, d in (("k", k, self.head_dim), ("v", v, self.v_head_dim)):
            if x.ndim != 3 or int(x.shape[0]) != self.num_heads or int(x.shape[2]) != d:
                raise ValueError(f"{name} must have shape ({self.num_heads}, tokens, {d}), received {tuple(x.shape)}")
            if not is_floating(xp, x.dtype):
                raise TypeError(f"{name} must have a floating dtype, received {dtype_name(x.dtype)}")
        if int(k.shape[1]) != int(v.shape[1]) or int(k.shape[1]) < 1:
            raise ValueError(
                f"k and v must hold the same number (>= 1) of tokens, received shapes "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.dtype != v.dtype:
            raise TypeError(f"k and v must share one dtype, received {dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
        if self.check_finite:
            check_finite(xp, k=k, v=v)
        return xp, int(k.shape[1])

    # -- tokens ---------------------------------------------------------------------
    def append(self, layer: int, seq_id: int, k: Array, v: Array) -> None:
        """Project full keys/values to latents and append them.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``, with projections (:meth:`set_projection`
            or :meth:`fit`).
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        k : array (num_heads, new_tokens, head_dim)
            Keys of the new tokens, floating; the last ``rope_dim`` channels are stored exactly.
        v : array (num_heads, new_tokens, v_head_dim)
            Values of the new tokens, in the dtype of ``k``.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        xp, t = self._check_kv(k, v)
        with self._locks[layer]:
            p = self._need_proj(layer)
            z = self._stack_tokens(xp, xp.astype(k, xp.float32), xp.astype(v, xp.float32))
            latent = xp.astype(xp.matmul(z, xp.matrix_transpose(p.down)), k.dtype)  # (t, latent)
            rope = k[:, :, self.nope_dim :]
            if self.shared_rope:
                if self.rope_dim and not bool(xp.all(rope == rope[:1, ...])):
                    raise ValueError("shared_rope=True needs the RoPE channels of every head to be equal")
                rope = rope[:1, ...]
            self._store(layer, xp, seq_id, latent, rope)

    def append_compressed(self, layer: int, seq_id: int, latent: Array, k_rope: Array | None = None) -> None:
        """Append latents computed by the model itself.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``, with projections (:meth:`set_projection`
            or :meth:`fit`).
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        latent : array (new_tokens, latent_dim)
            Latents of the new tokens, floating.
        k_rope : array (rope_heads, new_tokens, rope_dim); required when ``rope_dim > 0``
            ``rope_heads`` is 1 with ``shared_rope`` and ``num_heads`` otherwise.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        xp = _compat.namespace(latent)
        if latent.ndim != 2 or int(latent.shape[1]) != self.latent_dim or int(latent.shape[0]) < 1:
            raise ValueError(f"latent must have shape (tokens >= 1, {self.latent_dim}), received {tuple(latent.shape)}")
        if not is_floating(xp, latent.dtype):
            raise TypeError(f"latent must have a floating dtype, received {dtype_name(latent.dtype)}")
        t = int(latent.shape[0])
        if self.rope_dim:
            if k_rope is None:
                raise ValueError(f"k_rope is required when rope_dim={self.rope_dim}")
            want = (self.rope_heads, t, self.rope_dim)
            if _compat.namespace(k_rope) is not xp or tuple(int(s) for s in k_rope.shape) != want:
                raise ValueError(f"k_rope must have shape {want} in latent's library, received {tuple(k_rope.shape)}")
            if k_rope.dtype != latent.dtype:
                raise TypeError(
                    f"k_rope must have latent's dtype {dtype_name(latent.dtype)}, received {dtype_name(k_rope.dtype)}"
                )
        elif k_rope is not None:
            raise ValueError("k_rope must be None when rope_dim is 0")
        if self.check_finite:
            check_finite(xp, latent=latent, **({} if k_rope is None else {"k_rope": k_rope}))
        with self._locks[layer]:
            self._need_proj(layer)
            rope = (
                k_rope
                if self.rope_dim
                else xp.zeros((self.rope_heads, t, 0), dtype=latent.dtype, device=_compat.device(latent))
            )
            self._store(layer, xp, seq_id, latent, rope)

    def _need_proj(self, layer: int) -> _Projection:
        p = self._proj[layer]
        if p is None:
            raise ValueError(f"layer {layer} has no projections; call set_projection() or fit() first")
        return p

    def _store(self, layer: int, xp: Namespace, seq_id: int, latent: Array, rope: Array) -> None:
        sid = self._check_seq(seq_id)
        buf = self._data[layer].get(sid)
        arrays = {"latent": latent[None, None, :, :], "k_rope": rope[None, ...]}
        if buf is not None and buf.length:
            held = buf.view("latent")
            if _compat.namespace(held) is not xp or held.dtype != latent.dtype:
                raise TypeError(
                    f"seq_id {sid} holds {dtype_name(held.dtype)} latents; received {dtype_name(latent.dtype)}"
                )
        if buf is None:
            buf = TokenBuffers(min_capacity=16)
        buf.append(arrays)
        self._data[layer][sid] = buf

    def get_compressed_kv(self, layer: int, seq_id: int) -> tuple[Array, Array]:
        """``(latent (seq_len, latent_dim), k_rope (rope_heads, seq_len, rope_dim))`` (views).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id holding at least one token in ``layer``.

        Returns
        -------
        latent : array, shape (seq_len, latent_dim)
            The stored latents (a view of the cache's buffer, not a copy: never write into it).
        k_rope : array, shape (rope_heads, seq_len, rope_dim)
            The stored RoPE keys (a view).
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        with self._locks[layer]:
            buf = self._buf(layer, seq_id)
            return buf.view("latent")[0, 0, ...], buf.view("k_rope")[0, ...]

    def _buf(self, layer: int, seq_id: int) -> TokenBuffers:
        sid = self._check_seq(seq_id)
        buf = self._data[layer].get(sid)
        if buf is None or buf.length == 0:
            raise ValueError(f"seq_id {sid} holds no tokens in layer {layer}")
        return buf

    def get_kv(self, layer: int, seq_id: int) -> tuple[Array, Array]:
        """Reconstructed ``k`` (heads, seq_len, head_dim) and ``v`` (heads, seq_len, v_head_dim).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id holding at least one token in ``layer``.

        Returns
        -------
        k : array, shape (num_heads, seq_len, head_dim)
            ``up_k`` applied to the latents, then the stored RoPE channels; the latents' dtype.
        v : array, shape (num_heads, seq_len, v_head_dim)
            ``up_v`` applied to the latents, in the latents' dtype.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        with self._locks[layer]:
            buf = self._buf(layer, seq_id)
            p = self._proj[layer]
            assert p is not None  # tokens are stored only once the layer has projections
            latent = buf.view("latent")[0, 0, ...]
            rope = buf.view("k_rope")[0, ...]
            xp = _compat.namespace(latent)
            c = xp.astype(latent, xp.float32)
            k_nope = xp.astype(xp.matmul(p.up_k, xp.matrix_transpose(c)), latent.dtype)  # (h, nope, t)
            v = xp.astype(xp.matmul(p.up_v, xp.matrix_transpose(c)), latent.dtype)
            k_nope, v = xp.matrix_transpose(k_nope), xp.matrix_transpose(v)
            if self.rope_dim:
                t = int(latent.shape[0])
                rope = xp.broadcast_to(rope, (self.num_heads, t, self.rope_dim))
                k = xp.concat([k_nope, rope], axis=2)
            else:
                k = k_nope
            return k, v

    def fork(self) -> MlaCache:
        """An independent copy: the same sequences (same ids), latents and projections.

        The latents are copied (O(``memory_usage()``), under every layer lock); the projection
        arrays are shared, as they are replaced, never written in place (a
        :meth:`set_projection` or :meth:`fit` on either affects only that one).

        Returns
        -------
        MlaCache
            The copy.
        """
        twin = fork_store(self, "_data", lambda seqs: {s: b.copy() for s, b in seqs.items()})
        twin._proj = list(self._proj)
        return twin

    def truncate(self, layer: int, seq_id: int, length: int) -> None:
        """Keep the first ``length`` latents (and RoPE keys) of ``seq_id`` in ``layer``.

        Afterwards the sequence is as if the later tokens had never been appended: same
        ``seq_len``, ``get_kv``, ``get_compressed_kv`` and ``memory_usage``; spare room beyond
        the buffers' growth bound is released (:meth:`TokenBuffers.truncate`). Raises like
        :meth:`PagedKVCache.truncate`, changing nothing.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
            A live sequence id (from :meth:`allocate_sequence`, not freed).
        length : int
            Tokens kept, ``0 <= length <= seq_len(layer, seq_id)``.
        """
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        length = check_int("length", length, low=0)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            buf = self._data[layer].get(sid)
            held = 0 if buf is None else buf.length
            check_truncate_length(length, held, sid, layer)
            if length == 0:
                self._data[layer].pop(sid, None)
            elif length < held:
                assert buf is not None  # it holds tokens
                buf.truncate(length)

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
        layer = check_int("layer", layer, low=0, high=self.num_layers - 1)
        with self._locks[layer]:
            sid = self._check_seq(seq_id)
            buf = self._data[layer].get(sid)
            return 0 if buf is None else buf.length

    def memory_usage(self) -> int:
        """Bytes of the latents and RoPE keys held for stored tokens (projections excluded).

        Returns
        -------
        int
            Bytes over every layer and sequence (:meth:`projection_nbytes` counts the rest).
        """
        total = 0
        for i in range(self.num_layers):
            with self._locks[i]:
                total += sum(b.used_nbytes() for b in self._data[i].values())
        return total

    def projection_nbytes(self) -> int:
        """Bytes of the projections of every layer.

        Returns
        -------
        int
            Bytes of ``up_k``, ``up_v`` and ``down`` of the layers that have them.
        """
        total = 0
        for p in self._proj:
            if p is not None:
                total += sum(_compat.array_nbytes(a) for a in (p.up_k, p.up_v, p.down))
        return total

    def __repr__(self) -> str:
        return (
            f"MlaCache(num_layers={self.num_layers}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"latent_dim={self.latent_dim}, rope_dim={self.rope_dim})"
        )
