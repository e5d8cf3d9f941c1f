"""Implementations of the MF-PSN charge and the registry that holds them."""
from .registry import (BACKEND_LIBRARIES, LAYOUTS, Implementation, available_backends, backend_available,
                       batch_stats, bn_fire, bn_fire_direct, candidate_names, channel_dim, charge, check_backend, check_charge_args, check_layout, find, fire,
                       get, exact_where_overflowed, input_dtype_error, has_bn_fire_direct, implementations, names, not_here, param_fire, register, step_fire, supported, tap_schedule, time_dim)
from . import torch_ops  # noqa: F401  (registers the PyTorch implementations)
from . import cupy_ops  # noqa: F401  (registers 'cupy' only where cupy and a CUDA device are present)
from . import cpp_ops  # noqa: F401  (registers 'cpp' where a C++ compiler is found; built at first use)

try:  # registers the Triton implementation; without triton, backend='triton' says how to install it
    from . import triton_ops  # noqa: F401
except ImportError as exc:
    if not (exc.name or "").startswith("triton"):
        raise  # a bug of ours, not a missing triton
    from .registry import note_unavailable
    note_unavailable("triton", f"triton is installed but does not import ({exc})")

__all__ = ["BACKEND_LIBRARIES", "LAYOUTS", "Implementation", "available_backends", "backend_available", "batch_stats", "bn_fire", "bn_fire_direct", "candidate_names",
           "channel_dim", "charge", "check_backend", "check_charge_args", "check_layout", "find", "fire", "get", "has_bn_fire_direct",
           "exact_where_overflowed", "input_dtype_error",           "implementations", "names", "not_here", "param_fire", "register", "step_fire", "supported", "tap_schedule", "time_dim"]
