"""spikingjelly_mfpsn: the multiplication-free channel-wise Parallel Spiking Neuron for SpikingJelly.

Importing this package adds ``MulFreeChannelwisePSN`` to ``spikingjelly.activation_based.neuron``,
``autoselect``, ``fuse_batchnorm``, ``replace_neurons``, ``set_method``, ``unfuse_batchnorm`` (and
``set_backend``) to ``spikingjelly.activation_based.functional`` and ``TLastSeqToANNContainer`` to
``spikingjelly.activation_based.layer``, each where SpikingJelly lacks it (never replacing a name
SpikingJelly defines itself).
"""
from . import _compat, functional, layer, ops, tuner
from .convert import UnconvertibleModuleError, to_time_first, to_time_last
from .functional import (autoselect, fuse_batchnorm, replace_neurons, sawtooth, set_backend, set_method,
                         unfuse_batchnorm, update_bn)
from .neuron import MulFreeChannelwisePSN, default_method, exp_init_weight
from .quantize import quantize, quantize_pow2_, shift_amounts
from . import deploy, energy

__version__ = "0.1.0"

_compat.add_to_namespace(_compat.neuron, "MulFreeChannelwisePSN", MulFreeChannelwisePSN)
_compat.add_to_namespace(_compat.layer, "TLastSeqToANNContainer", layer.TLastSeqToANNContainer)
# SpikingJelly 0.0.0.0.14 has its own functional.set_backend, which is kept: it works on MF-PSN too.
for _name in ("autoselect", "fuse_batchnorm", "replace_neurons", "set_method", "unfuse_batchnorm") + \
        (() if _compat.HAS_SET_BACKEND else ("set_backend",)):
    _compat.add_to_namespace(_compat.functional, _name, getattr(functional, _name))

__all__ = ["MulFreeChannelwisePSN", "UnconvertibleModuleError", "autoselect", "default_method", "deploy", "energy",
           "exp_init_weight", "functional", "fuse_batchnorm", "layer", "ops", "quantize", "quantize_pow2_",
           "replace_neurons", "sawtooth", "set_backend", "set_method", "shift_amounts", "to_time_first", "to_time_last",
           "tuner", "unfuse_batchnorm", "update_bn", "__version__"]
