"""GPU selection and collection kernels (CuPy RawKernels) with NumPy twins.

Every kernel has a NumPy twin with the same semantics; functions take NumPy arrays
(twin) or CuPy arrays (GPU) and dispatch on them. See docs/KERNELS.md.
"""

from .backend import gpu_available, is_device_array
from .gather import Batch, Window, gather, gather_numpy, output_plan, to_jax, to_torch
from .hostmem import HostRegistration
from .rng import CounterRng
from .selection import scatter, weighted_sample

__all__ = [
    "Batch",
    "CounterRng",
    "HostRegistration",
    "Window",
    "gather",
    "gather_numpy",
    "gpu_available",
    "is_device_array",
    "output_plan",
    "scatter",
    "to_jax",
    "to_torch",
    "weighted_sample",
]
