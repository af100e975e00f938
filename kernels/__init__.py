"""GPU selection and collection kernels (CuPy RawKernels) with NumPy twins.

Installed as ``gear_kernels``.
"""
