"""The only module that knows which SpikingJelly is installed.

Supported: SpikingJelly 2.0.x (no ``backend`` on neurons, no ``functional.set_backend``, ships
``layer.TLastSeqToANNContainer``) and 0.0.0.0.14 (neurons take ``backend=``,
``functional.set_backend`` exists, no PSN family, no time-last containers).
"""
from __future__ import annotations

import importlib.metadata
import logging

import torch.nn as nn
from packaging.version import Version
from spikingjelly.activation_based import base, functional, layer, neuron, surrogate

logger = logging.getLogger("spikingjelly_mfpsn")

SJ_VERSION = Version(importlib.metadata.version("spikingjelly"))
SJ2 = SJ_VERSION >= Version("0.0.0.1")  # 2.x; 0.0.0.0.14 sorts below it
HAS_SET_BACKEND = hasattr(functional, "set_backend")
TLastSeqToANNContainer = getattr(layer, "TLastSeqToANNContainer", None)

MemoryModule = base.MemoryModule
MultiStepModule = base.MultiStepModule
StepModule = base.StepModule


if SJ2:
    BatchNorm1d = layer.BatchNorm1d
else:
    class BatchNorm1d(layer.BatchNorm1d):
        """``layer.BatchNorm1d`` that also takes multi-step ``(T, N, C)`` (0.0.0.0.14 wants ``(T, N, C, L)``)."""

        def forward(self, x):
            if self.step_mode == "m" and x.dim() == 3:
                return nn.BatchNorm1d.forward(self, x.flatten(0, 1)).view(x.shape)
            return super().forward(x)


def default_surrogate():
    return surrogate.ATan()


def invalidate_reset_cache(net) -> None:
    """SpikingJelly 2.x caches the modules ``reset_net`` visits; drop it after swapping modules."""
    fn = getattr(functional, "invalidate_reset_cache", None)
    if fn is not None:
        fn(net)


def add_to_namespace(namespace, name: str, obj) -> bool:
    """Add ``obj`` to a SpikingJelly namespace as ``name`` unless SpikingJelly defines that name.

    Idempotent: adding the same object twice is a no-op. Returns True when ``namespace.name`` is
    ``obj`` afterwards.
    """
    current = getattr(namespace, name, None)
    if current is obj:
        return True
    if current is not None and not getattr(current, "__module__", "").startswith("spikingjelly_mfpsn"):
        logger.warning("%s.%s already exists; spikingjelly_mfpsn leaves it alone",
                       namespace.__name__, name)
        return False
    setattr(namespace, name, obj)
    return True


__all__ = ["SJ_VERSION", "SJ2", "HAS_SET_BACKEND", "TLastSeqToANNContainer", "BatchNorm1d", "MemoryModule",
           "MultiStepModule", "StepModule", "default_surrogate", "invalidate_reset_cache",
           "add_to_namespace", "base", "functional", "layer", "neuron", "surrogate"]
