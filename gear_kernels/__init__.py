"""GPU selection and collection kernels (CuPy RawKernels) with NumPy twins.

Every kernel has a NumPy twin with the same semantics; functions take NumPy arrays
(twin) or CuPy arrays (GPU) and dispatch on them. See docs/KERNELS.md.
"""

from ._backend import gpu_available, is_device_array
from .gather import Batch, Window, gather, gather_numpy, output_plan, to_jax, to_torch
from .hostmem import HostRegistration
from .rng import CounterRng
from .selection import (
    argbest,
    increment_times_sampled,
    sample_without_replacement,
    scatter,
    top_k,
    weighted_sample,
)

__all__ = [
    "Batch",
    "CounterRng",
    "HostRegistration",
    "Window",
    "argbest",
    "gather",
    "gather_numpy",
    "gpu_available",
    "increment_times_sampled",
    "is_device_array",
    "output_plan",
    "sample_without_replacement",
    "scatter",
    "to_jax",
    "to_torch",
    "top_k",
    "weighted_sample",
]
