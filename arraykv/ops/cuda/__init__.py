"""CUDA kernels for CuPy arrays: ``kernels/*.cu`` compiled through one loader (``loader``).

Imported only when an op first asks for a kernel; each module raises ImportError when CuPy is
missing.
"""
