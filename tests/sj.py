"""What the installed SpikingJelly provides, read from SpikingJelly itself (not from the package's shims)."""
import importlib.metadata

from packaging.version import Version
from spikingjelly.activation_based import functional, neuron

VERSION = Version(importlib.metadata.version("spikingjelly"))
PSN = getattr(neuron, "PSN", None)  # the parallel spiking neuron (2.x only)
try:  # operation counters (2.x only)
    from spikingjelly.activation_based import op_counter
except ImportError:
    op_counter = None


def defines(namespace, name: str) -> bool:
    """Whether SpikingJelly itself defines ``namespace.name`` (rather than spikingjelly_mfpsn adding it)."""
    return getattr(getattr(namespace, name, None), "__module__", "").startswith("spikingjelly.")


HAS_SET_BACKEND = defines(functional, "set_backend")  # 0.0.0.0.14 has its own
