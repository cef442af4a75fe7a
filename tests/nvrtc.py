"""Compile CUDA sources with NVRTC through ctypes (no GPU and no CuPy needed).

``cupy.RawModule`` compiles ``kernels/*.cu`` with NVRTC, which has no CUDA include folder on
its search path; ``nvcc`` has one, so a source that ``nvcc`` accepts can still fail at run
time. Tests use :func:`compile_source` to catch that on machines without a GPU, when an NVRTC
library can be found (``ARRAYKV_NVRTC`` = path of ``libnvrtc.so``, the ``nvidia-cuda-nvrtc``
wheel, or the system library).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os


def find_nvrtc() -> str | None:
    """Path of an NVRTC shared library, or None."""
    env = os.environ.get("ARRAYKV_NVRTC")
    if env and os.path.exists(env):
        return env
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        hits = sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[-1]
    return ctypes.util.find_library("nvrtc")


def compile_source(lib_path: str, text: str, name: str, name_expressions, options) -> tuple:
    """Compile ``text`` to PTX; return ``(ok, log, lowered names)``."""
    folder = os.path.dirname(lib_path)
    for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)  # found beside libnvrtc, not on the loader path
            break
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), name.encode(), 0, None, None)
    if rc:
        return False, f"nvrtcCreateProgram failed ({rc})", {}
    try:
        for expr in name_expressions:
            lib.nvrtcAddNameExpression(prog, expr.encode())
        opts = [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        lowered = {}
        if rc == 0:
            for expr in name_expressions:
                out = ctypes.c_char_p()
                if lib.nvrtcGetLoweredName(prog, expr.encode(), ctypes.byref(out)) == 0:
                    lowered[expr] = out.value.decode()
        return rc == 0, log, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
