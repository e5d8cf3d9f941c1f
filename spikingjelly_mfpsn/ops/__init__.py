"""Implementations of the MF-PSN charge and the registry that holds them."""
from .registry import (BACKEND_LIBRARIES, LAYOUTS, Implementation, available_backends, backend_available,
                       channel_dim, charge, check_backend, check_charge_args, check_layout, get,
                       implementations, names, register, supported, time_dim)
from . import torch_ops  # noqa: F401  (registers the PyTorch implementations)
from . import cupy_ops  # noqa: F401  (registers 'cupy' only where cupy and a CUDA device are present)

__all__ = ["BACKEND_LIBRARIES", "LAYOUTS", "Implementation", "available_backends", "backend_available",
           "channel_dim", "charge", "check_backend", "check_charge_args", "check_layout", "get",
           "implementations", "names", "register", "supported", "time_dim"]
