"""spikingjelly_mfpsn: the multiplication-free channel-wise Parallel Spiking Neuron for SpikingJelly.

Importing this package adds ``MulFreeChannelwisePSN`` to ``spikingjelly.activation_based.neuron``
and, where SpikingJelly lacks it, ``TLastSeqToANNContainer`` to ``spikingjelly.activation_based.layer``
(never replacing a name SpikingJelly defines itself).
"""
from . import _compat, ops
from . import layer
from .convert import UnconvertibleModuleError, to_time_first, to_time_last
from .neuron import MulFreeChannelwisePSN, default_method, exp_init_weight
from .quantize import quantize, quantize_pow2_, shift_amounts

__version__ = "0.1.0"

_compat.add_to_namespace(_compat.neuron, "MulFreeChannelwisePSN", MulFreeChannelwisePSN)
_compat.add_to_namespace(_compat.layer, "TLastSeqToANNContainer", layer.TLastSeqToANNContainer)

__all__ = ["MulFreeChannelwisePSN", "UnconvertibleModuleError", "default_method", "exp_init_weight", "layer",
           "ops", "quantize", "quantize_pow2_", "shift_amounts", "to_time_first", "to_time_last", "__version__"]
