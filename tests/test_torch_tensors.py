"""PyTorch tensors through every cache method and through the kernels (``arraykv.ops.bridge``).

A torch cache and a NumPy cache fed the same data must hold the same state and return the
same arrays: the kernels run on the tensors' memory (DLPack), so the only differences left
are those of the array-API code run by torch instead of NumPy (linear algebra in the low-rank
fit). Skipped as a whole where torch is not installed; the CUDA tests skip without a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
xt = pytest.importorskip("array_api_compat.torch")

import array_api_compat.numpy as xnp  # noqa: E402

import arraykv  # noqa: E402
from arraykv import ops  # noqa: E402
from arraykv.ops import registry  # noqa: E402

from cache_contract import rotary_embed  # noqa: E402
from conftest import BUILTIN_METHODS  # noqa: E402

METHODS = list(BUILTIN_METHODS)
#: (kv_heads, query heads per KV head, head_dim): GQA at 64, MHA at an odd 48.
GEOMETRIES = [(2, 2, 64), (3, 1, 48)]
CPU = torch.device("cpu")
CUDA_OK = torch.cuda.is_available()


def _tolerance(method: str, dtype) -> float:
    """Largest allowed difference between a torch and a NumPy cache holding the same state,
    in units of ``eps(dtype) * max(1, |x|)``.

    Measured (20 seeds x 2 geometries x 2 dtypes x every method; a torch prefill of 70-140
    tokens restored into a NumPy cache, then the same three decodes and a 5-token prefill on
    both; every returned and stored array): 0 for every method but ``lowrank``, whose new
    tokens are projected on the basis by array-API code (a matmul: torch's and NumPy's sum in
    different orders): up to 4563 eps in float32 (5.4e-4) and 0.97 eps in float16. Its bound is
    four times that.
    """
    if method == "lowrank":
        return 4 * 4563.0 if dtype == np.float32 else 4.0
    return 0.0


def _assert_close(method, ref, got, what):
    """``got`` (a torch tensor) equals NumPy's ``ref`` within the method's measured tolerance."""
    assert isinstance(got, torch.Tensor), (what, type(got))
    assert got.device == CPU, what
    got = got.numpy()
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, ref.dtype, got.shape, ref.shape)
    if ref.dtype.kind != "f":
        np.testing.assert_array_equal(got, ref, err_msg=what)
        return
    tol = _tolerance(method, ref.dtype) * float(np.finfo(ref.dtype).eps)
    r64, g64 = ref.astype(np.float64), got.astype(np.float64)
    err = np.abs(g64 - r64) / np.maximum(1.0, np.abs(r64))
    assert np.all(np.isfinite(g64) == np.isfinite(r64)), what
    worst = float(err.max()) if err.size else 0.0
    assert worst <= tol, f"{what}: {worst:.3g} > {tol:.3g}"


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def _kvq(rng, b, hkv, g, t, d, dtype):
    return [rng.standard_normal(s).astype(dtype) for s in ((b, hkv, t, d), (b, hkv, t, d), (b, hkv * g, t, d))]


def _results(out):
    """The arrays of a decode output, by name."""
    if isinstance(out, arraykv.Fused):
        return {"output": out.output}
    r = out.result
    res = {"k": r.k, "v": r.v}
    if r.logit_bias is not None:
        res["logit_bias"] = r.logit_bias
    return res


def _numpy_copy(cache):
    """A NumPy cache holding exactly ``cache``'s state (through snapshot and restore)."""
    out = arraykv.make_cache(**cache.get_config())
    out.restore(
        [
            None if r is None else dataclasses.replace(r, arrays={n: a.numpy().copy() for n, a in r.arrays.items()})
            for r in cache.snapshot()
        ],
        xp=xnp,
    )
    return out


def _error(cache, k, v):
    r = cache.dequantize(0)
    got = [np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a, np.float64) for a in (r.k, r.v)]
    return sum(float(((g - x) ** 2).sum()) for g, x in zip(got, (k, v)))


def _run_pair(method, rng, hkv, g, d, dtype, *, prompt, steps, layout=_t):
    """A torch cache after a prompt, a NumPy cache in its state, and the same decode steps on both.

    Returns both caches and ``(what, numpy result, torch result)`` for every decode output.
    """
    ct = arraykv.make_cache(method, num_layers=1, num_kv_heads=hkv, head_dim=d)
    k, v, q = _kvq(rng, 2, hkv, g, prompt, d, dtype)
    r = ct.prefill(0, layout(k), layout(v), layout(q))
    assert isinstance(r.k, torch.Tensor)
    cn = _numpy_copy(ct)
    cfg = arraykv.AttendConfig(d**-0.5, g)
    pairs = []
    for s in range(steps):
        k, v, q = _kvq(rng, 2, hkv, g, 1, d, dtype)
        on, ot = cn.decode(0, k, v, q, cfg), ct.decode(0, layout(k), layout(v), layout(q), cfg)
        assert type(on) is type(ot), (method, type(on), type(ot))
        rn_, rt_ = _results(on), _results(ot)
        assert sorted(rn_) == sorted(rt_)
        pairs += [(f"decode{s}.{n}", rn_[n], rt_[n]) for n in rn_]
    return cn, ct, pairs


def _same_state(method, cn, ct, layer=0):
    an, at = cn.layer_arrays(layer), ct.layer_arrays(layer)
    assert sorted(an) == sorted(at)
    for name in an:
        _assert_close(method, an[name], at[name], f"state {name}")
    dn, dt = cn.dequantize(layer), ct.dequantize(layer)
    _assert_close(method, dn.k, dt.k, "dequantize.k")
    _assert_close(method, dn.v, dt.v, "dequantize.v")


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["gqa64", "mha48"])
@pytest.mark.parametrize("method", METHODS)
def test_torch_cache_equals_numpy_cache(method, geometry, dtype, rng):
    """Fed the same calls, a torch cache and a NumPy cache in the same state return the same arrays.

    The first prefill calibrates (means, k-means++ seeds, bases) with array-API code that
    sums in torch's order, so a code near a threshold or a k-means++ draw may come out
    otherwise than on NumPy (measured on 30 seeds: up to 69 of 5e5 codes, once a different vq
    codebook): the fits are compared by their reconstruction error (measured relative
    difference at most 5.8e-4, for vq; bound 1 %). From one state on, everything is compared
    array by array.
    """
    hkv, g, d = geometry
    prompt = int(rng.integers(70, 140))  # past the windows: every method encodes, fits and fuses
    k, v, q = _kvq(rng, 2, hkv, g, prompt, d, dtype)
    ct = arraykv.make_cache(method, num_layers=1, num_kv_heads=hkv, head_dim=d)
    fresh = arraykv.make_cache(method, num_layers=1, num_kv_heads=hkv, head_dim=d)
    rt, rn = ct.prefill(0, _t(k), _t(v), _t(q)), fresh.prefill(0, k, v, q)
    for a, b in ((rt.k, rn.k), (rt.v, rn.v)):
        assert isinstance(a, torch.Tensor) and a.dtype == getattr(torch, np.dtype(dtype).name) and a.shape == b.shape
    et, en = _error(ct, k, v), _error(fresh, k, v)
    assert abs(et - en) <= 0.01 * en, (et, en)
    cn = _numpy_copy(ct)
    _same_state(method, cn, ct)
    cfg = arraykv.AttendConfig(d**-0.5, g)
    for step, t in enumerate((1, 1, 5, 1)):
        k, v, q = _kvq(rng, 2, hkv, g, t, d, dtype)
        if t == 1:
            on, ot = cn.decode(0, k, v, q, cfg), ct.decode(0, _t(k), _t(v), _t(q), cfg)
            assert type(on) is type(ot), (type(on), type(ot))
            got, ref = _results(ot), _results(on)
        else:
            rn, rt = cn.prefill(0, k, v, q), ct.prefill(0, _t(k), _t(v), _t(q))
            got, ref = {"k": rt.k, "v": rt.v}, {"k": rn.k, "v": rn.v}
        assert sorted(got) == sorted(ref)
        for name in ref:
            _assert_close(method, ref[name], got[name], f"step {step} {name}")
    _same_state(method, cn, ct)
    assert ct.seq_len(0) == cn.seq_len(0) == prompt + 8
    assert ct.memory_usage() == cn.memory_usage()
    ct.reset()
    assert ct.seq_len(0) == 0 and ct.dequantize(0) is None and ct.memory_usage() == ct._fixed_nbytes()


@pytest.fixture
def no_implicit_host_copies(monkeypatch):
    """Torch tensors that refuse ``numpy.asarray`` (``__array__``), as CUDA tensors do.

    A conversion a CPU tensor allows silently but a CUDA tensor refuses (found on a GPU:
    ``numpy.asarray`` of a device tensor in the rotary-mean fit) then fails on any machine.
    The library's own conversions are explicit (``.cpu().numpy()``, DLPack) and still work.
    """

    def refuse(self, *args, **kwargs):
        raise TypeError("implicit conversion of a torch tensor to NumPy")

    monkeypatch.setattr(torch.Tensor, "__array__", refuse)


@pytest.mark.parametrize("method", METHODS)
def test_no_implicit_conversion_of_tensors(method, rng, no_implicit_host_copies, tmp_path):
    """Every call of every method on tensors, with keys of a rotary model (the rotating key mean
    is fitted), never converts a tensor implicitly: what a CUDA tensor would refuse."""
    hkv, g, d = GEOMETRIES[0]
    c = arraykv.make_cache(method, num_layers=1, num_kv_heads=hkv, head_dim=d)
    k, v, q = _kvq(rng, 2, hkv, g, 120, d, np.float32)
    mu = rng.standard_normal((2, hkv, 1, d)) * 3.0  # keys with a rotating mean: the rotary fit runs
    k = rotary_embed(mu + k).astype(np.float32)
    c.prefill(0, _t(k), _t(v), _t(q))
    cfg = arraykv.AttendConfig(d**-0.5, g)
    for t in (1, 1, 3, 1):
        k, v, q = _kvq(rng, 2, hkv, g, t, d, np.float32)
        if t == 1:
            c.decode(0, _t(k), _t(v), _t(q), cfg)
        else:
            c.prefill(0, _t(k), _t(v), _t(q))
    assert isinstance(c.dequantize(0).k, torch.Tensor)
    twin = c.fork()
    twin.truncate_all(max(twin.min_truncate_length(0), twin.seq_len(0) - 1))
    c.save(tmp_path / "c.akv")
    back = arraykv.load(tmp_path / "c.akv", xp=xt)
    assert back.seq_len(0) == c.seq_len(0)


@pytest.mark.parametrize("method", METHODS)
def test_fork_truncate_save_load_on_torch(method, rng, tmp_path):
    hkv, g, d = GEOMETRIES[0]
    cn, ct, _ = _run_pair(method, rng, hkv, g, d, np.float32, prompt=90, steps=4)
    fn, ft = cn.fork(), ct.fork()
    cut = max(fn.min_truncate_length(0), 91)
    fn.truncate_all(cut)
    ft.truncate_all(cut)
    assert ft.seq_len(0) == fn.seq_len(0) == cut and ct.seq_len(0) == 94 and cut < 94  # the fork only
    _same_state(method, fn, ft)
    # the fork keeps decoding on tensors like the NumPy fork
    k, v, q = _kvq(rng, 2, hkv, g, 1, d, np.float32)
    cfg = arraykv.AttendConfig(d**-0.5, g)
    on, ot = fn.decode(0, k, v, q, cfg), ft.decode(0, _t(k), _t(v), _t(q), cfg)
    for n, ref in _results(on).items():
        _assert_close(method, ref, _results(ot)[n], f"fork decode {n}")
    # a file saved from tensors loads into NumPy as the NumPy cache's state, and back into torch
    path = tmp_path / "c.akv"
    ct.save(path)
    back_np = arraykv.load(path)
    back_t = arraykv.load(path, xp=xt)
    held = ct.layer_arrays(0)
    for name, a in back_np.layer_arrays(0).items():
        assert isinstance(a, np.ndarray)
        np.testing.assert_array_equal(a, held[name].numpy(), err_msg=name)
    assert sorted(back_np.layer_arrays(0)) == sorted(held)
    _same_state(method, cn, back_t)


def test_saved_file_names_the_dtype_not_the_library(tmp_path):
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=64)
    k = torch.randn(1, 2, 9, 64, dtype=torch.float16)
    cache.prefill(0, k, k, torch.randn(1, 2, 9, 64, dtype=torch.float16))
    assert cache.snapshot()[0].dtype == "float16"
    cache.save(tmp_path / "c.akv")
    loaded = arraykv.load(tmp_path / "c.akv", xp=xt)
    assert loaded.dequantize(0).k.dtype == torch.float16


@pytest.mark.parametrize("method", ["pqo3", "int4", "vq", "dense"])
def test_non_contiguous_tensors(method, rng):
    """Strided tensors (every other element of a wider one) give what contiguous NumPy input gives."""

    def strided(a):
        t = torch.from_numpy(np.repeat(a, 2, axis=-1))[..., ::2]
        assert not t.is_contiguous() and torch.equal(t, torch.from_numpy(a))
        return t

    hkv, g, d = GEOMETRIES[1]
    cn, ct, pairs = _run_pair(method, rng, hkv, g, d, np.float32, prompt=100, steps=2, layout=strided)
    for what, ref, got in pairs:
        _assert_close(method, ref, got, what)
    _same_state(method, cn, ct)


def test_reference_path_runs_on_torch(rng):
    """With the kernels off, every method runs on tensors through the array-API code alone."""
    hkv, g, d = GEOMETRIES[0]
    with ops.set_kernels_enabled(False):
        assert ops.lookup("pack_bits", xt, CPU) is None
        for method in METHODS:
            _, ct, pairs = _run_pair(method, rng, hkv, g, d, np.float32, prompt=80, steps=1)
            for what, ref, got in pairs:
                assert isinstance(got, torch.Tensor) and got.dtype == torch.float32, (method, what)
                # NumPy and torch differ only in float summation order (BLAS, reductions)
                np.testing.assert_allclose(got.numpy(), ref, rtol=1e-3, atol=1e-3, err_msg=f"{method} {what}")
            assert ct.seq_len(0) == 81


# -- the bridge itself ----------------------------------------------------------------------------


def _spy_reference(x, state, scale):
    """Reference of the spy op (never run here)."""
    raise AssertionError("the spy op's reference ran instead of its kernel")


SEEN: list = []


@dataclasses.dataclass(frozen=True)
class _Holder:
    rotation: object


def _spy_kernel(x, state, scale):
    """A NumPy 'kernel' that records what it received and returns a fresh array and a view."""
    SEEN.append(
        (
            type(x),
            x.ctypes.data,
            x.strides,
            x.flags.writeable,
            type(state.rotation.signs),
            state.rotation.signs.ctypes.data,
            scale,
        )
    )
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    SEEN.append(out.ctypes.data)
    return out, x[:, :1]


@pytest.fixture
def spy_op():
    name = "_torch_spy"
    registry.register_op(name, f"{__name__}:_spy_reference", numpy=f"{__name__}:_spy_kernel")
    SEEN.clear()
    try:
        yield name
    finally:
        registry._OPS.pop(name, None)
        for key in [key for key in registry._RESOLVED if key[0] == name]:
            del registry._RESOLVED[key]


def test_kernel_gets_the_tensors_memory_and_returns_its_own(spy_op):
    from arraykv.quant.rotation import make_rotation

    fn = registry.lookup(spy_op, xt, CPU)
    assert fn is not None and fn.__wrapped__ is _spy_kernel
    base = torch.randn(4, 6)
    x = base.t()  # non-contiguous: the kernel sees the strided view, no copy
    rot = make_rotation(64, seed=3, like=base)
    holder = _Holder(rotation=rot)  # nested dataclasses are rebuilt around converted fields
    out, view = fn(x, holder, 0.5)
    (kind, ptr, strides, writeable, sign_kind, sign_ptr, scale), out_ptr = SEEN
    assert kind is np.ndarray and ptr == x.data_ptr() and strides == (4, 24) and writeable
    assert sign_kind is np.ndarray and sign_ptr == rot.signs.data_ptr()
    assert scale == 0.5
    assert isinstance(out, torch.Tensor) and out.data_ptr() == out_ptr
    assert torch.equal(out, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert isinstance(view, torch.Tensor) and view.data_ptr() == x.data_ptr()  # a view of the input stays one
    assert holder.rotation is rot and isinstance(rot.signs, torch.Tensor)  # the caller's dataclass is untouched


def test_lookup_routes_torch_by_device():
    for name in ops.op_names():
        np_kernel = registry.lookup(name, xnp)
        cpu = registry.lookup(name, xt, CPU)
        if np_kernel is None:
            assert cpu is None, name
        else:
            assert cpu.__wrapped__ is np_kernel, name
        assert registry.lookup(name, xt, torch.device("meta")) is None
        has_any = any(registry.kernel_target(name, b) for b in registry.BACKENDS)
        assert (registry.lookup(name, xt) is not None) == has_any
        assert ops.has_kernel(name, xt, CPU) == (np_kernel is not None)
    with ops.set_kernels_enabled(False):
        assert registry.lookup("polar_encode", xt, CPU) is None


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_ops_on_tensors_equal_numpy_kernels(bits, rng):
    """Op entries on (strided) tensors return tensors equal to the NumPy kernels' results."""
    codes = rng.integers(0, 1 << bits, (3, 5, 37)).astype(np.uint8)
    t = torch.from_numpy(np.ascontiguousarray(codes.transpose(1, 0, 2))).transpose(0, 1)
    packed = ops.pack_bits(t, bits)
    np.testing.assert_array_equal(packed.numpy(), ops.pack_bits(codes, bits))
    np.testing.assert_array_equal(ops.unpack_bits(packed, bits, 37).numpy(), codes)
    x = rng.standard_normal((2, 3, 7, 40)).astype(np.float32)
    mn, mx = ops.intq_group_minmax(_t(x), 8)
    mn_, mx_ = ops.intq_group_minmax(x, 8)
    np.testing.assert_array_equal(mn.numpy(), mn_)
    np.testing.assert_array_equal(mx.numpy(), mx_)
    dense, sparse = ops.split_outliers(_t(x), 2.0)
    dense_, sparse_ = ops.split_outliers(x, 2.0)
    np.testing.assert_array_equal(dense.numpy(), dense_)
    np.testing.assert_array_equal(sparse.index.numpy(), sparse_.index)
    np.testing.assert_array_equal(sparse.value.numpy(), sparse_.value)


# -- refusals ---------------------------------------------------------------------------------------


def test_bfloat16_is_refused_with_the_dtypes_allowed():
    cache = arraykv.make_cache("pqo4", num_layers=1, num_kv_heads=2, head_dim=64)
    k = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(
        TypeError, match=r"k must have a floating dtype \(float16, float32, float64\), received bfloat16"
    ):
        cache.prefill(0, k, k, k)
    assert cache.seq_len(0) == 0


def test_tensors_that_require_grad_are_refused():
    cache = arraykv.make_cache("int4", num_layers=1, num_kv_heads=2, head_dim=64)
    k = torch.randn(1, 2, 4, 64, requires_grad=True)
    with pytest.raises(TypeError, match="k requires grad.*detach"):
        cache.prefill(0, k, k.detach(), k.detach())
    with pytest.raises(TypeError, match="q requires grad"):
        cache.prefill(0, k.detach(), k.detach(), k)
    assert cache.seq_len(0) == 0
    with torch.no_grad():
        cache.prefill(0, k * 1.0, k * 1.0, k * 1.0)
    assert cache.seq_len(0) == 4


# -- CUDA (not run without a GPU) -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_OK, reason="torch has no CUDA device here")
@pytest.mark.parametrize("method", ["pqo4", "tq3", "int4", "vq", "dense"])
def test_cuda_tensors_stay_on_their_device(method, rng):
    """CUDA tensors: results on the GPU, close to the CPU cache (GPU kernels round differently)."""
    pytest.importorskip("cupy")
    hkv, g, d = GEOMETRIES[0]
    dev = torch.device("cuda")
    cfg = arraykv.AttendConfig(d**-0.5, g)
    cn = arraykv.make_cache(method, num_layers=1, num_kv_heads=hkv, head_dim=d)
    cc = arraykv.make_cache(method, num_layers=1, num_kv_heads=hkv, head_dim=d)
    k, v, q = _kvq(rng, 2, hkv, g, 100, d, np.float32)
    cn.prefill(0, k, v, q)
    assert cc.prefill(0, *(_t(a).to(dev) for a in (k, v, q))).k.device.type == "cuda"
    k, v, q = _kvq(rng, 2, hkv, g, 1, d, np.float32)
    on, oc = cn.decode(0, k, v, q, cfg), cc.decode(0, *(_t(a).to(dev) for a in (k, v, q)), cfg)
    for got in _results(oc).values():
        assert got.device.type == "cuda"
    dn, dc = cn.dequantize(0), cc.dequantize(0)
    assert dc.k.device.type == "cuda"
    np.testing.assert_allclose(dc.k.cpu().numpy(), dn.k, rtol=0, atol=0.05)
    ref = on.output if isinstance(on, arraykv.Fused) else None
    if ref is not None and isinstance(oc, arraykv.Fused):
        np.testing.assert_allclose(oc.output.cpu().numpy(), ref, rtol=0, atol=1e-2)


@pytest.mark.parametrize("method", ["dense", "pqo4", "int4", "vq"])
def test_meta_sparse_and_misplaced_tensors_are_refused_before_anything_is_stored(method):
    """A meta tensor (no data), a sparse one, or a query on another device than k and v: refused
    up front with ValueError/TypeError, so a retry stores the token once."""
    cache = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=64)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 40, 64, generator=g)
    q = torch.randn(1, 4, 40, 64, generator=g)
    cache.prefill(0, k, k, q)
    before = cache.layer_arrays(0)
    k1, q1 = k[:, :, :1].clone(), q[:, :, :1].clone()
    cfg = arraykv.AttendConfig(0.125, 2)
    with pytest.raises(ValueError, match="meta tensor"):
        cache.decode(0, k1, k1, torch.empty(1, 4, 1, 64, device="meta"), cfg)
    with pytest.raises(TypeError, match="dense"):
        cache.decode(0, k1.to_sparse(), k1, q1, cfg)
    empty = arraykv.make_cache(method, num_layers=1, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="meta tensor"):
        empty.prefill(0, torch.empty(1, 2, 3, 64, device="meta"), k1, q1)
    assert cache.seq_len(0) == 40 and empty.seq_len(0) == 0
    after = cache.layer_arrays(0)
    assert after.keys() == before.keys() and all(np.array_equal(after[n], before[n]) for n in after)
