"""spikingjelly_mfpsn: the multiplication-free channel-wise Parallel Spiking Neuron for SpikingJelly.

Importing this package adds ``MulFreeChannelwisePSN`` to ``spikingjelly.activation_based.neuron``
(never replacing a name SpikingJelly defines itself).
"""
from . import _compat, ops
from .neuron import MulFreeChannelwisePSN, default_method, exp_init_weight
from .quantize import quantize, quantize_pow2_, shift_amounts
from . import deploy, energy  # noqa: E402  (submodules: spikingjelly_mfpsn.deploy, .energy)

__version__ = "0.1.0"

_compat.add_to_namespace(_compat.neuron, "MulFreeChannelwisePSN", MulFreeChannelwisePSN)

__all__ = ["MulFreeChannelwisePSN", "default_method", "deploy", "energy", "exp_init_weight", "ops", "quantize",
           "quantize_pow2_", "shift_amounts", "__version__"]
