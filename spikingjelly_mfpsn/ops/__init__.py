"""Implementations of the MF-PSN charge, the registry that holds them, and the functional core."""
from .registry import (BACKEND_LIBRARIES, LAYOUTS, BackendUnavailableError, Implementation, available_backends,
                       backend_available, candidate_names, channel_dim, check_backend, check_charge_args, check_layout,
                       choose, find, get, implementations, input_dtype_error, names, not_here, register, supported,
                       tap_schedule, time_dim, unregister)
from .core import (BatchNorm, batch_stats, bn_fire, bn_fire_direct, charge, exact_where_overflowed, fire, mf_psn,
                   mf_psn_step, param_fire, step_fire, step_taps)
from . import surrogate, torch_ops  # noqa: F401  (registers the PyTorch implementations)
from . import cupy_ops  # noqa: F401  (registers 'cupy' only where cupy and a CUDA device are present)
from . import cpp_ops  # noqa: F401  (registers 'cpp' where a C++ compiler is found; built at first use)

try:  # registers the Triton implementation; without triton, backend='triton' says how to install it
    from . import triton_ops  # noqa: F401
except ImportError as exc:
    if not (exc.name or "").startswith("triton"):
        raise  # a bug of ours, not a missing triton
    from .registry import note_unavailable
    note_unavailable("triton", f"triton is installed but does not import ({exc})")

__all__ = ["BACKEND_LIBRARIES", "LAYOUTS", "BackendUnavailableError", "BatchNorm", "Implementation", "available_backends", "backend_available",
           "batch_stats", "bn_fire", "bn_fire_direct", "candidate_names", "channel_dim", "charge", "check_backend",
           "check_charge_args", "check_layout", "choose", "exact_where_overflowed", "find", "fire", "get",
           "implementations", "input_dtype_error", "mf_psn", "mf_psn_step", "names", "not_here", "param_fire",
           "register", "step_fire", "step_taps", "supported", "surrogate", "tap_schedule", "time_dim", "unregister"]
