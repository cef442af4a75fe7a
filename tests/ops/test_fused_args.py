"""The fused kernels' named tuples of arguments and the signatures their steps are compiled for."""

from __future__ import annotations

import pytest
from numba import types as nbt

from arraykv.ops.numba import fused_driver, int_fused, lowrank_fused, vq_fused
from arraykv.ops.numba.polar import fused as polar_fused

KERNELS = {
    "polar": (polar_fused, polar_fused.PolarArgs, [polar_fused._SIG]),
    "int": (int_fused, int_fused.IntArgs, int_fused._SIGS),
    "vq": (vq_fused, vq_fused.VQArgs, vq_fused._SIGS),
    "lowrank": (lowrank_fused, lowrank_fused.LowRankArgs, [lowrank_fused._SIG]),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_signature_has_one_type_per_field(name):
    # the compiled steps take the named tuple's fields as a plain tuple, in the class's order
    _, cls, sigs = KERNELS[name]
    for sig in sigs:
        bundle = sig.args[4]
        assert isinstance(bundle, nbt.BaseAnonymousTuple)
        assert len(bundle.types) == len(cls._fields), (cls.__name__, len(bundle.types), cls._fields)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_steps_make_the_kernels_own_named_tuple(name):
    # the step templates' global ``Args`` is renamed to the class's own name in the kernel module
    mod, cls, _ = KERNELS[name]
    for step in (mod._step_serial, mod._step_parallel):
        for fn in step._fns.values():
            assert cls.__name__ in fn.__code__.co_names and "Args" not in fn.__code__.co_names
            assert fn.__globals__[cls.__name__] is cls


def test_a_class_that_is_not_a_global_of_the_kernel_module_is_refused():
    class Elsewhere(tuple):
        pass

    with pytest.raises(ValueError, match="Elsewhere"):
        fused_driver.build_steps(vars(int_fused), Elsewhere, int_fused._SIGS)
