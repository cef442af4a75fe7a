"""The LMCache serializer: KV chunks through an arraykv cache file and back.

The chunk functions are pure NumPy and run everywhere. The LMCache classes run where
``lmcache.v1.distributed.serde`` imports (a CUDA-built wheel that pins NumPy <= 2.2.6; its
serde layer imports on a CPU-only machine in an environment of its own): they are skipped
elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from arraykv.store import EntryError
from arraykv.store.lmcache_serde import MAGIC, decode_chunk, encode_chunk, serialized_size

SHAPE = (2, 3, 128, 128)  # [2, layers, tokens, kv_heads * head_dim], head_dim 64


def chunk(seed: int, scale: float = 1.0, outliers: bool = False, dtype=np.float16) -> np.ndarray:
    kv = np.random.default_rng(seed).standard_normal(SHAPE) * scale
    if outliers:
        kv[0, :, :, [5, 70]] *= 15.0
    return kv.astype(dtype)


@pytest.mark.parametrize(
    "case", [dict(seed=1), dict(seed=2, scale=30.0), dict(seed=3, outliers=True), dict(seed=4, dtype=np.float32)]
)
def test_round_trip_within_the_codec_error_and_under_the_declared_size(case):
    kv = chunk(**case)
    data = encode_chunk(kv, head_dim=64)
    assert data.startswith(MAGIC)
    assert len(data) <= serialized_size(SHAPE, kv.dtype, head_dim=64)
    assert kv.astype(np.float32).nbytes / 2 / len(data) > 3.0  # float16 bytes over the chunk's (3.1 at 128 tokens)
    out = decode_chunk(data + bytes(300), SHAPE, head_dim=64)
    x = kv.astype(np.float32)
    assert out.shape == SHAPE and out.dtype == np.float32
    for i in (0, 1):
        err = float(((out[i] - x[i]) ** 2).sum() / (x[i] ** 2).sum())
        assert err < 0.03, (i, err)  # 4-bit rotated codes: about 0.009 on Gaussian data


def test_damaged_or_foreign_chunks_are_refused():
    kv = chunk(5)
    data = encode_chunk(kv, head_dim=64)
    with pytest.raises(EntryError, match="magic"):
        decode_chunk(b"XXXXXXXX" + data[8:], SHAPE, head_dim=64)
    with pytest.raises(EntryError, match="buffer holds"):
        decode_chunk(data[: len(data) // 2], SHAPE, head_dim=64)  # the length runs past the buffer
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    with pytest.raises(EntryError, match="checksum"):
        decode_chunk(bytes(flipped), SHAPE, head_dim=64)
    with pytest.raises(EntryError, match="another configuration"):
        decode_chunk(encode_chunk(kv, head_dim=64, method="pqo3"), SHAPE, head_dim=64)
    with pytest.raises(EntryError, match="should hold 64"):
        decode_chunk(data, (2, 3, 64, 128), head_dim=64)


def test_bad_shapes_and_dtypes_are_refused():
    with pytest.raises(ValueError, match="shape"):
        encode_chunk(np.zeros((3, 2, 4, 64), np.float16), head_dim=64)
    with pytest.raises(ValueError, match="head_dim"):
        encode_chunk(np.zeros((2, 2, 4, 100), np.float16), head_dim=64)
    with pytest.raises(TypeError, match="float16 or float32"):
        encode_chunk(np.zeros((2, 2, 4, 64), np.int8), head_dim=64)


def test_the_lmcache_serde_interface():
    pytest.importorskip("lmcache.v1.distributed.serde", reason="lmcache (a CUDA-built wheel) is not installed")
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from arraykv.store.lmcache_serde import register, serde_classes

    register()
    register()  # once per process, whatever the calls
    assert "arraykv" in get_registered_serde_types()
    processor = create_serde_processor(SerdeConfig(type="arraykv", kwargs={"head_dim": 64}))
    assert processor is not None
    ser_cls, de_cls = serde_classes()
    ser, de = ser_cls(head_dim=64), de_cls(head_dim=64)

    def obj(t):
        meta = MemoryObjMetadata(
            shape=t.shape,
            dtype=t.dtype,
            address=0,
            phy_size=t.numel() * t.element_size(),
            ref_count=1,
            fmt=MemoryFormat.KV_2LTD,
        )
        return TensorMemoryObj(t.reshape(-1).view(torch.uint8), meta, None)

    kv = torch.from_numpy(chunk(7)).to(torch.bfloat16)
    layout = MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype])
    size = ser.estimate_serialized_size(layout)
    assert size == ser.estimate_serialized_size(layout) < kv.numel() * 2 / 3.0  # deterministic, from shapes
    key = ObjectKey(chunk_hash=b"\x01" * 32, model_name="tiny", kv_rank=0)
    dst = obj(torch.full((size,), 7, dtype=torch.uint8))
    n = ser.serialize(obj(kv), dst, key)
    assert 0 < n <= size
    again = obj(torch.zeros((size,), dtype=torch.uint8))
    assert ser.serialize(obj(kv), again, key) == n and torch.equal(again.tensor, dst.tensor)  # deterministic
    out = obj(torch.zeros(SHAPE, dtype=torch.bfloat16))
    de.deserialize(dst, out, key)
    x, y = kv.float(), out.tensor.float()
    assert float(((x - y) ** 2).sum() / (x**2).sum()) < 0.03
    small = obj(torch.zeros((n // 2,), dtype=torch.uint8))
    with pytest.raises(ValueError, match="buffer"):
        ser.serialize(obj(kv), small, key)
