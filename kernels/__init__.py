"""CUDA C++ sources of arraykv, installed as the package ``arraykv.kernels``.

The ``.cu`` files beside this one are read at run time by :mod:`arraykv.ops.cuda.loader` and
compiled with ``cupy.RawModule``; this file only makes the folder a package so that the sources
ship inside the wheel and are found from an editable install alike.
"""
