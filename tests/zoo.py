"""Small networks from SpikingJelly's model zoo, importable without torchvision.

The zoo modules (``spiking_vgg``, ``spiking_resnet``, ``sew_resnet``) import torchvision only for
``load_state_dict_from_url`` (pretrained weights, never used here), and torchvision does not import
beside a CPU-only torch build. :func:`zoo_module` imports a zoo module with a stand-in ``torchvision``
that provides exactly the names the zoo's import lines ask for, taken from ``torch.hub``, and removes
the stand-in again so nothing else sees a fake torchvision.

Every builder returns a multi-step network (``step_mode='m'``, input ``(T, N, 3, H, W)``) whose
spiking neurons are ``neuron_cls(**neuron_kwargs)``, e.g.
``spiking_resnet(MulFreeChannelwisePSN, k=2)``.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch.hub
import torch.nn as nn
from spikingjelly.activation_based import functional, layer

# The zoo modules try ``torchvision.models.utils`` first, then ``torchvision._internally_replaced_utils``.
_STUB_MODULES = ("torchvision", "torchvision.models", "torchvision.models.utils",
                 "torchvision._internally_replaced_utils")


@contextlib.contextmanager
def _torchvision_stand_in():
    saved = {name: sys.modules[name] for name in _STUB_MODULES if name in sys.modules}
    for name in _STUB_MODULES:
        stub = types.ModuleType(name)
        stub.load_state_dict_from_url = torch.hub.load_state_dict_from_url
        sys.modules[name] = stub
    sys.modules["torchvision"].models = sys.modules["torchvision.models"]
    sys.modules["torchvision.models"].utils = sys.modules["torchvision.models.utils"]
    try:
        yield
    finally:
        for name in _STUB_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def zoo_module(name: str):
    """``spikingjelly.activation_based.model.<name>`` (``'spiking_vgg'``, ``'spiking_resnet'``,
    ``'sew_resnet'``), imported with the torchvision stand-in if it is not imported yet."""
    full = f"spikingjelly.activation_based.model.{name}"
    if full in sys.modules:
        return sys.modules[full]
    with _torchvision_stand_in():
        return importlib.import_module(full)


def _multi_step(net: nn.Module) -> nn.Module:
    functional.set_step_mode(net, "m")
    return net


def spiking_vgg(neuron_cls, num_classes: int = 10, cfg=(8, "M", 16, "M"), batch_norm: bool = True,
                **neuron_kwargs) -> nn.Module:
    """A small SpikingVGG: the zoo's feature extractor built from ``cfg``, then (replacing the zoo's
    ImageNet-sized classifier) a 1x1 adaptive average pool and ``Linear(last conv width, num_classes)``."""
    vgg = zoo_module("spiking_vgg")
    channels = [v for v in cfg if v != "M"][-1]
    net = vgg.SpikingVGG(list(cfg), batch_norm=batch_norm, num_classes=num_classes, init_weights=True,
                         spiking_neuron=neuron_cls, **neuron_kwargs)
    net.avgpool = layer.AdaptiveAvgPool2d((1, 1))
    net.classifier = nn.Sequential(layer.Linear(channels, num_classes))
    return _multi_step(net)


def spiking_resnet(neuron_cls, num_classes: int = 10, layers=(1, 1, 1, 1), **neuron_kwargs) -> nn.Module:
    """SpikingResNet with BasicBlocks (``layers`` blocks per stage; the zoo fixes widths 64..512)."""
    m = zoo_module("spiking_resnet")
    net = m.SpikingResNet(m.BasicBlock, list(layers), num_classes=num_classes,
                          spiking_neuron=neuron_cls, **neuron_kwargs)
    return _multi_step(net)


def sew_resnet(neuron_cls, num_classes: int = 10, layers=(1, 1, 1, 1), cnf: str = "ADD",
               **neuron_kwargs) -> nn.Module:
    """SEWResNet with BasicBlocks and the element-wise connection ``cnf`` (``'ADD'``, ``'AND'``, ``'IAND'``)."""
    m = zoo_module("sew_resnet")
    net = m.SEWResNet(m.BasicBlock, list(layers), num_classes=num_classes, cnf=cnf,
                      spiking_neuron=neuron_cls, **neuron_kwargs)
    return _multi_step(net)


BUILDERS = {"spiking_vgg": spiking_vgg, "spiking_resnet": spiking_resnet, "sew_resnet": sew_resnet}
