"""Small networks from SpikingJelly's model zoo, importable without torchvision.

The zoo modules (``spiking_vgg``, ``spiking_resnet``, ``sew_resnet``) import torchvision only for
``load_state_dict_from_url`` (pretrained weights, never used here), and torchvision does not import
beside a CPU-only torch build. :func:`zoo_module` imports a zoo module with a stand-in ``torchvision``
that provides exactly the names the zoo's import lines ask for, taken from ``torch.hub``, and removes
the stand-in again so nothing else sees a fake torchvision.

Every builder returns a multi-step network (``step_mode='m'``, input ``(T, N, 3, H, W)``) whose
spiking neurons are ``neuron_cls(**neuron_kwargs)``, e.g.
``spiking_resnet(MulFreeChannelwisePSN, k=2)``.

:data:`ZOO` holds, for the installed SpikingJelly, every constructor of its model zoo that takes a
spiking neuron, called as it is (``num_classes=10``, ``T=2`` and 32x32 images where it takes them):
``ZOO[name](neuron_cls=IFNode, **neuron_kwargs) -> (net, example_input)``, ``net`` multi-step and
``example_input`` a fixed ``(T, N, C, H, W)`` tensor the net takes. :data:`FAMILIES` names one small
member per family (for tests that cover each family once).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

import torch
import torch.hub
from spikingjelly.activation_based import functional, layer, neuron
from torch import nn

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
    ``'sew_resnet'``, ``'ms_resnet'``, ...), imported with the torchvision stand-in if it is not imported yet."""
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


# --------------------------------------------------------------------------------------------------
# The whole zoo, as SpikingJelly builds it
# --------------------------------------------------------------------------------------------------

T = 2  # time steps of the example inputs (where a net allows it)
N = 2  # batch size of the example inputs

#: name -> ``build(neuron_cls=IFNode, **neuron_kwargs) -> (net, example_input)``; each builder also
#: carries ``constructor`` ('module.function') and ``family``.
ZOO: dict = {}


def _has(module: str) -> bool:
    return importlib.util.find_spec(f"spikingjelly.activation_based.model.{module}") is not None


def _add(name: str, family: str, module: str, constructor: str, shape=(3, 32, 32), t: int = T, **kwargs):
    """Register ``ZOO[name]``: ``model.<module>.<constructor>(spiking_neuron=neuron_cls, **kwargs,
    **neuron_kwargs)`` in multi-step mode, with a fixed ``(t, N, *shape)`` example input."""

    def build(neuron_cls=neuron.IFNode, **neuron_kwargs):
        net = getattr(zoo_module(module), constructor)(spiking_neuron=neuron_cls, **kwargs, **neuron_kwargs)
        x = torch.rand((t, N, *shape), generator=torch.Generator().manual_seed(0))
        return _multi_step(net), x

    build.__name__ = build.__qualname__ = name
    build.__doc__ = f"``{module}.{constructor}(**{kwargs})`` and a {(t, N, *shape)} input."
    build.constructor, build.family = f"{module}.{constructor}", family
    ZOO[name] = build


_RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
            "resnext101_32x8d", "wide_resnet50_2", "wide_resnet101_2")

# In SpikingJelly 0.0.0.0.14 and 2.0.0. Every VGG ends in the fixed ImageNet classifier
# (512*7*7 -> 4096 -> 4096 -> classes, ~124M of the ~129M parameters) whatever the image size.
for _depth in (11, 13, 16, 19):
    _add(f"spiking_vgg{_depth}", "spiking_vgg", "spiking_vgg", f"spiking_vgg{_depth}", num_classes=10)
    _add(f"spiking_vgg{_depth}_bn", "spiking_vgg_bn", "spiking_vgg", f"spiking_vgg{_depth}_bn", num_classes=10)
for _arch in _RESNETS:
    _add(f"spiking_{_arch}", "spiking_resnet", "spiking_resnet", f"spiking_{_arch}", num_classes=10)
for _arch in _RESNETS:  # cnf has no default (None fails in forward)
    _add(f"sew_{_arch}", "sew_resnet", "sew_resnet", f"sew_{_arch}", num_classes=10, cnf="ADD")
if _has("parametric_lif_net"):  # no num_classes argument: 10 classes, DVSGestureNet 11
    _add("MNISTNet", "parametric_lif_net", "parametric_lif_net", "MNISTNet", shape=(1, 28, 28))
    _add("FashionMNISTNet", "parametric_lif_net", "parametric_lif_net", "FashionMNISTNet", shape=(1, 28, 28))
    _add("NMNISTNet", "parametric_lif_net", "parametric_lif_net", "NMNISTNet", shape=(2, 32, 32))  # 32..35 px
    _add("CIFAR10Net", "parametric_lif_net", "parametric_lif_net", "CIFAR10Net")
    # Four (five) 2x2 pools before Linear(channels*8*8) (channels*4*4): 128x128 is the smallest input.
    _add("CIFAR10DVSNet", "parametric_lif_net", "parametric_lif_net", "CIFAR10DVSNet", shape=(2, 128, 128))
    _add("DVSGestureNet", "parametric_lif_net", "parametric_lif_net", "DVSGestureNet", shape=(2, 128, 128))

# SpikingJelly 2.0.0 only. These build their neurons in multi-step mode themselves.
if _has("ms_resnet"):
    _add("ms_resnet18", "ms_resnet", "ms_resnet", "ms_resnet18", T=T, num_classes=10)
    _add("ms_resnet34", "ms_resnet", "ms_resnet", "ms_resnet34", T=T, num_classes=10)
    _add("max_resnet18", "max_resnet", "ms_resnet", "max_resnet18", T=T, num_classes=10)
if _has("masnn"):
    _add("att_ms_resnet18", "att_ms_resnet", "masnn", "att_ms_resnet18", T=T, num_classes=10)
    # Its temporal attention fixes reduction_t=5 and asserts T >= 5; the input T must equal T.
    _add("masnn_dvs128_gesture", "masnn", "masnn", "masnn_dvs128_gesture", shape=(2, 32, 32), t=5, T=5,
         num_classes=10)
if _has("spikformer"):
    _add("spikformer_ti", "spikformer", "spikformer", "spikformer_ti", T=T, img_size_h=32, img_size_w=32,
         num_classes=10)
    _add("spikformer_s", "spikformer", "spikformer", "spikformer_s", T=T, img_size_h=32, img_size_w=32,
         num_classes=10)
    _add("spikformer_cifar10", "spikformer", "spikformer", "spikformer_cifar10", T=T, num_classes=10)
if _has("maxformer"):
    # cifar=True (maxformer_cifar) builds other blocks (_MaxCifarEmbed, _MaxCifarSSA): its own family.
    _add("maxformer_10_384", "maxformer", "maxformer", "maxformer_10_384", T=T, num_classes=10)
    _add("maxformer_cifar", "maxformer_cifar", "maxformer", "maxformer_cifar", T=T, num_classes=10)
if _has("qkformer"):
    _add("qkformer_10_384", "qkformer", "qkformer", "qkformer_10_384", T=T, num_classes=10)
if _has("spike_driven_transformer"):
    _add("sdt_8_384", "sdt", "spike_driven_transformer", "sdt_8_384", T=T, num_classes=10)
if _has("spiking_vggws_ottt"):  # default neuron OTTTLIFNode; ottt_spiking_vggws has the light classifier
    _add("ottt_spiking_vggws", "ottt", "spiking_vggws_ottt", "ottt_spiking_vggws", num_classes=10)
    for _depth in (11, 13, 16, 19):
        for _ws in ("", "_ws"):
            _add(f"ottt_spiking_vgg{_depth}{_ws}", "ottt", "spiking_vggws_ottt", f"ottt_spiking_vgg{_depth}{_ws}",
                 num_classes=10)

# Not in ZOO:
# - model.snas_net.SNASNet and model.spike_dhs.SpikeDHS (2.0.0, not exported by model/__init__): they
#   take no spiking neuron (LIFNode / save_v_LIFNode are hard-coded) and an argparse-style ``args``.
# - the classes behind the constructors above (SpikingVGG, SpikingResNet, SEWResNet, MSResNet, MaxResNet,
#   AttMSResNet, MASNN, Spikformer, MaxFormer, QKFormer, SpikeDrivenTransformer, OTTTSpikingVGG).
# - SEWResNet34Config/Builder and Spikformer(CIFAR10)Config/Builder (2.0.0): distributed-training
#   builders (process groups, pipeline stages) around sew_resnet34 and the Spikformers.
# - 0.0.0.0.14's train_classify, train_imagenet_example and tv_ref_classify: training scripts.
# Every constructor that takes a spiking neuron builds and runs on the CPU with IFNode (torch backend):
# none needs CUDA, CuPy or a torchvision operator.

#: family -> the ZOO name of its smallest member, for the families the installed SpikingJelly has.
#: All are the zoo's own constructors, unshrunk: each runs a forward pass in under 0.3 s on a 2-core
#: CPU (T=2, N=2, 32x32), so none needed shrinking. The VGGs are heavy to build all the same (~1.6 s,
#: ~129M parameters, see above; their constructors have no width argument); the small
#: ``spiking_vgg()`` builder stands in for them where that matters, at the price of a replaced classifier.
FAMILIES = {family: name for family, name in {
    "spiking_vgg": "spiking_vgg11",
    "spiking_vgg_bn": "spiking_vgg11_bn",
    "spiking_resnet": "spiking_resnet18",
    "sew_resnet": "sew_resnet18",
    "parametric_lif_net": "CIFAR10Net",
    "ms_resnet": "ms_resnet18",
    "max_resnet": "max_resnet18",
    "att_ms_resnet": "att_ms_resnet18",
    "masnn": "masnn_dvs128_gesture",
    "spikformer": "spikformer_ti",
    "maxformer": "maxformer_10_384",
    "maxformer_cifar": "maxformer_cifar",
    "qkformer": "qkformer_10_384",
    "sdt": "sdt_8_384",
    "ottt": "ottt_spiking_vggws",
}.items() if name in ZOO}
