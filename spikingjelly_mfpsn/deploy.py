"""Mul-free inference: folded MF-PSN neurons and their integer bit-shift charge (paper Sec. 4.2, App. C).

After training, a ``threshold='bn'`` neuron's batch normalisation is constant, so its fused, quantised
weight and its bias are constants too (paper Eq. weight/bias fuse)::

    H[t, c] = sum_i sign[c, i] * 2**shift[c, i] * X[t - (k-1-i)*d, c] + bias[c],     S = Theta(H)

:func:`fold` replaces every :class:`~spikingjelly_mfpsn.MulFreeChannelwisePSN` of a network by a
:class:`FoldedMulFreePSN` that stores only ``shift`` and ``sign`` (int8, ``(C, k)``) and ``bias``
(float, ``(C,)``). It runs in one of two arithmetics:

* float (default): one charge call of the registry (:func:`spikingjelly_mfpsn.ops.charge`) with the
  weight ``sign * 2**shift``; bit for bit the unfolded neuron's eval output.
* integer (:func:`set_integer`): the neuron's input is a fixed-point integer ``q = round(X * 2**F)``
  (``F = frac_bits`` fractional bits; float inputs are converted on entry, integer inputs are taken as
  already in that format) and ``H`` is computed by :func:`int_charge` with ``torch.bitwise_left_shift``
  / ``bitwise_right_shift``, negation and additions only (no multiplication).

Exactness. The accumulator carries ``P = acc_frac_bits`` fractional bits; by default
``P = F + max(0, -min(shift))``, so every tap is a *left* shift by ``shift + P - F >= 0``: nothing is
rounded and the accumulator is exactly ``sum_i Wq X * 2**P``. The bias enters as
``floor(bias * 2**P)``, which makes ``acc + floor(bias * 2**P) >= 0`` equivalent to the exact
``sum_i Wq X + bias >= 0``. So for inputs that are multiples of ``2**-F`` the integer spikes are those of
exact arithmetic, and they equal the float path whenever the float path is itself exact (float64
with every partial sum inside 53 significant bits, which holds for ordinary activations and
parameters). float32 rounds partial sums to 24 bits, and inputs off the ``2**-F`` grid are rounded on
entry: there the agreement is measured by :func:`agreement` instead of promised. A smaller
``acc_frac_bits`` makes negative shift amounts real arithmetic right shifts (floor), trading
accumulator width for exactness.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch
import torch.nn as nn

from . import _compat, functional, ops
from ._util import module_slots, run_hooked
from .neuron import PADDED_HISTORY, ChargeNeuronBase, CheckpointConfig, MulFreeChannelwisePSN
from .ops.registry import channel_view_shape, tap_schedule

#: Default number of fractional bits of a neuron's fixed-point input (without calibration data: see
#: :func:`set_integer`). 24 bits hold float32 activations' fractions with the integer part's 30-odd
#: bits to spare.
FRAC_BITS = 24

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_MAX_BITS = 62  # magnitude bits an int64 accumulator may use (one spare bit below the sign)


# ---------------------------------------------------------------------------------- fixed point
def _check_bits(value, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_BITS:
        raise ValueError(f"{name} must be an int in [0, {_MAX_BITS}], got {value!r}")
    return value


def _check_formats(frac_bits: Optional[int], acc_frac_bits: Optional[int]) -> None:
    for value, name in ((frac_bits, "frac_bits"), (acc_frac_bits, "acc_frac_bits")):
        if value is not None:
            _check_bits(value, name)


def to_fixed(x: torch.Tensor, frac_bits: int = FRAC_BITS) -> torch.Tensor:
    """``round(x * 2**frac_bits)`` as int64: the fixed-point form of a float tensor.

    Exact (no rounding) for values that are multiples of ``2**-frac_bits``.
    """
    _check_bits(frac_bits, "frac_bits")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    scaled = torch.round(x.double() * 2.0 ** frac_bits)
    if not torch.isfinite(scaled).all() or (scaled.abs() >= 2.0 ** _MAX_BITS).any():
        raise OverflowError(f"x * 2**{frac_bits} does not fit the int64 fixed-point format (NaN, inf or "
                            f"|x| >= 2**{_MAX_BITS - frac_bits}); lower frac_bits")
    return scaled.to(torch.int64)


def from_fixed(q: torch.Tensor, frac_bits: int = FRAC_BITS, dtype: torch.dtype = torch.float32):
    """The float value ``q * 2**-frac_bits`` of a fixed-point tensor.

    Scaled in float64 where ``q`` may not fit ``dtype``'s range (float16)."""
    check_fixed(q)
    work = torch.float64 if torch.finfo(dtype).max < 2.0 ** 63 else dtype
    return torch.ldexp(q.to(work), torch.tensor(-_check_bits(frac_bits, "frac_bits"), dtype=work)).to(dtype)


def check_fixed(q, name: str = "q") -> None:
    """Raise ``TypeError`` unless ``q`` is an integer (fixed-point) tensor."""
    if not isinstance(q, torch.Tensor) or q.dtype not in _INT_DTYPES:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"{name} must be an integer (fixed-point) tensor, got {got}; convert a float tensor "
                        f"with spikingjelly_mfpsn.deploy.to_fixed(x, frac_bits)")


def exact_acc_frac_bits(shift: torch.Tensor, frac_bits: int) -> int:
    """Accumulator fractional bits for which every tap is a left shift: ``F + max(0, -min(shift))``."""
    return frac_bits + max(0, -int(shift.min())) if shift.numel() else frac_bits


def int_bias(bias: torch.Tensor, acc_frac_bits: int) -> torch.Tensor:
    """``floor(bias * 2**acc_frac_bits)`` as int64 (a constant, computed once per format).

    Rounding down keeps the firing decision exact: for an integer accumulator ``a``,
    ``a + floor(b * 2**P) >= 0`` exactly when ``a * 2**-P + b >= 0``.
    """
    scaled = torch.floor(bias.detach().double() * 2.0 ** _check_bits(acc_frac_bits, "acc_frac_bits"))
    if not torch.isfinite(scaled).all() or (scaled.abs() >= 2.0 ** _MAX_BITS).any():
        raise OverflowError(f"bias * 2**{acc_frac_bits} does not fit int64 (|bias| up to "
                            f"{float(bias.detach().abs().max()):g})" + ("; lower acc_frac_bits" if acc_frac_bits else ""))
    return scaled.to(torch.int64)


# ---------------------------------------------------------------------------------- integer charge
def _check_taps(shift: torch.Tensor, sign: torch.Tensor, channels: int, dilation) -> None:
    for t, name in ((shift, "shift"), (sign, "sign")):
        check_fixed(t, name)
        if t.dim() != 2 or t.shape[0] != channels:
            raise ValueError(f"{name} must have shape (C, k) = ({channels}, k), got {tuple(t.shape)}")
    if shift.shape != sign.shape:
        raise ValueError(f"shift {tuple(shift.shape)} and sign {tuple(sign.shape)} must have the same shape")
    if sign.numel() and int(sign.abs().max()) > 1:
        raise ValueError(f"sign must hold -1, 0 or +1, got values up to {int(sign.abs().max())} in magnitude")
    if not isinstance(dilation, int) or isinstance(dilation, bool) or dilation < 1:
        raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")


def _check_int(value, name: str, least: Optional[int] = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or least is not None and value < least:
        raise ValueError(f"{name} must be an int" + (f" >= {least}" if least is not None else "") + f", got {value!r}")


def _check_range(q: torch.Tensor, amount: torch.Tensor) -> None:
    """Refuse formats whose accumulator could overflow int64 (instead of wrapping silently)."""
    # (from the extremes, as Python ints: abs() of int64's most negative value stays negative)
    top = max(int(q.max()), -int(q.min())) if q.numel() else 0
    left = int(amount.max()) if amount.numel() else 0
    bits = top.bit_length() + max(0, left) + amount.shape[1].bit_length()
    if bits > _MAX_BITS:
        raise OverflowError(f"the accumulator needs {bits} bits (inputs up to {top}, left shifts up to "
                            f"{left}, {amount.shape[1]} taps) but int64 holds {_MAX_BITS}; "
                            f"lower frac_bits or acc_frac_bits")


def int_charge(q: torch.Tensor, shift: torch.Tensor, sign: torch.Tensor, dilation: int,
               layout: str = "time_first", extra_bits: int = 0, last: Optional[int] = None,
               tally: Optional[dict] = None) -> torch.Tensor:
    """The MF-PSN charge without bias, in integer arithmetic (shifts, negation, additions).

    It computes::

        acc[t, c] = sum_i sign[c, i] * sh(q[t - (k-1-i)*d, c], shift[c, i] + extra_bits)

    where ``sh(v, a)`` is ``v << a`` for ``a >= 0`` and the arithmetic (flooring) ``v >> -a`` otherwise.
    If ``q`` has ``F`` fractional bits, ``acc`` has ``F + extra_bits``; with ``extra_bits >= -min(shift)``
    it equals ``sum_i Wq X * 2**(F + extra_bits)`` exactly.

    Args:
        q: integer tensor, time-first ``(T, N, C, ...)`` or time-last ``(N, C, ..., T)``
        shift: integer exponents ``(C, k)``; ``sign``: -1/0/+1 ``(C, k)`` (see ``export_shifts``)
        last: compute only the last ``last`` time steps (single-step inference passes 1)
        tally: if given, ``tally['shift']`` and ``tally['add']`` grow by the element operations run
            (one shift and one add-or-subtract per tap that falls inside the sequence)

    Returns:
        int64 tensor of ``q``'s shape (``last`` steps along time if given)
    """
    check_fixed(q)
    ops.check_layout(layout)
    if q.dim() < 3:
        raise ValueError(f"q must have at least 3 dims (a sequence), got shape {tuple(q.shape)}")
    qt = (q.movedim(-1, 0) if layout == "time_last" else q).to(torch.int64)
    _check_taps(shift, sign, qt.shape[2], dilation)
    _check_int(extra_bits, "extra_bits")
    if last is not None:
        _check_int(last, "last", 1)
    t_len, k = qt.shape[0], shift.shape[1]
    start = 0 if last is None else max(0, t_len - last)
    amount = shift.to(torch.int64) + extra_bits
    _check_range(qt, amount)
    view = channel_view_shape(qt.dim(), "time_first")
    acc = torch.zeros((t_len - start,) + qt.shape[1:], dtype=torch.int64, device=qt.device)
    for i, lag, first in tap_schedule(t_len, k, dilation, start):
        a = amount[:, i].view(view)
        term = torch.bitwise_left_shift(qt[first - lag:t_len - lag], a.clamp(min=0))
        if (a < 0).any():  # per element one of the two shifts is by 0: one shift per tap and element
            term = torch.bitwise_right_shift(term, (-a).clamp(min=0))
        s = sign[:, i].view(view)
        term = torch.where(s < 0, -term, term).masked_fill(s == 0, 0)  # add or subtract, or skip
        acc[first - start:] += term
        if tally is not None:
            tally["shift"] = tally.get("shift", 0) + term.numel()
            tally["add"] = tally.get("add", 0) + term.numel()
    return acc.movedim(0, -1) if layout == "time_last" else acc


def int_fire(q: torch.Tensor, shift: torch.Tensor, sign: torch.Tensor, bias_int: torch.Tensor,
             dilation: int, layout: str = "time_first", extra_bits: int = 0,
             last: Optional[int] = None, tally: Optional[dict] = None) -> torch.Tensor:
    """Spikes (bool) of the integer neuron: ``int_charge(...) + bias_int >= 0``.

    ``bias_int`` is :func:`int_bias` at the accumulator's fractional bits (``F + extra_bits``); adding it
    is one addition per element (the paper's per-step threshold ADD). A ``bias_int`` of 2**62 or more in
    magnitude, which that addition could wrap around, raises OverflowError.
    """
    check_fixed(bias_int, "bias_int")
    acc = int_charge(q, shift, sign, dilation, layout, extra_bits, last, tally)
    if bias_int.shape != shift.shape[:1]:
        raise ValueError(f"bias_int must have shape (C,) = ({shift.shape[0]},), got {tuple(bias_int.shape)}")
    top = max(int(bias_int.max()), -int(bias_int.min())) if bias_int.numel() else 0
    if top.bit_length() > _MAX_BITS:  # (then the addition below could wrap around)
        raise OverflowError(f"bias_int holds values up to {top} in magnitude, over the {_MAX_BITS} bits the "
                            "int64 accumulator leaves it (int_bias refuses such a bias)")
    acc += bias_int.to(torch.int64).view(channel_view_shape(acc.dim(), layout))
    if tally is not None:
        tally["add"] = tally.get("add", 0) + acc.numel()
    return acc >= 0


# ---------------------------------------------------------------------------------- folded neuron
class FoldedMulFreePSN(CheckpointConfig, ChargeNeuronBase):
    """Inference-only MF-PSN: ``shift``/``sign`` (int8, ``(C, k)``) and ``bias`` (``(C,)``), no float weight.

    Built by :func:`fold`. Eval only: a forward in training mode raises (use :func:`unfold` to train
    again). ``step_mode``, ``layout`` and ``method`` mean what they mean for the neuron. ``frac_bits``
    is ``None`` for the float path, else the fixed-point format of the integer path (see
    :func:`set_integer`).
    """

    # The float path is the neuron's own forward code (ChargeNeuronBase); only where (Wq, b) come
    # from differs.
    SHAPE_KEY = "shift"  # (CheckpointConfig: a checkpoint's k and channels)

    def __init__(self, channels: int, k: int, dilation: int = 1, step_mode: str = "s",
                 layout: str = "time_first", method: str = "auto", backend: str = "torch",
                 surrogate_function=None, bias_dtype: torch.dtype = torch.float32):
        super().__init__()
        for value, name in ((channels, "channels"), (k, "k"), (dilation, "dilation")):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.k, self.dilation, self.step_mode = k, dilation, step_mode
        self._layout = ops.check_layout(layout)
        self._backend = ops.check_backend(backend)
        self._method = method if method == "auto" else ops.get(method).name
        # Kept for unfold(); in eval its forward is the Heaviside step.
        self.surrogate_function = surrogate_function if surrogate_function is not None else _compat.default_surrogate()
        self.register_buffer("shift", torch.zeros(channels, k, dtype=torch.int8))
        self.register_buffer("sign", torch.ones(channels, k, dtype=torch.int8))
        self.register_buffer("bias", torch.zeros(channels, dtype=bias_dtype))
        self.frac_bits: Optional[int] = None
        self.acc_frac_bits: Optional[int] = None
        self.layer_name: Optional[str] = None  # its name in the network (set_integer sets it), for errors
        self.register_memory("x_queue", ())
        self.eval()

    def _checkpoint_mismatch(self, state_dict, prefix: str) -> str:
        """As the neuron's, and a ``sign`` other than -1, 0 or +1 (the float path would run ``sign * 2**shift``,
        not a power of two, where the integer path refuses it)."""
        sign = state_dict.get(prefix + "sign")
        if isinstance(sign, torch.Tensor) and sign.numel() and bool((sign.abs() > 1).any()):
            return (f"the checkpoint's {f'layer {prefix[:-1]!r}' if prefix else 'neuron'} has a sign that is not "
                    f"-1, 0 or +1 (values up to {float(sign.abs().max()):g} in magnitude): not a folded MF-PSN's")
        return super()._checkpoint_mismatch(state_dict, prefix)

    @classmethod
    def from_neuron(cls, neuron: MulFreeChannelwisePSN) -> "FoldedMulFreePSN":
        """Fold one neuron (its eval-mode fused weight and bias: running statistics for 'bn')."""
        if neuron.channels is None:
            raise ValueError("cannot fold a MulFreeChannelwisePSN whose channels are not known yet; run one "
                             "forward (or pass channels=) first")
        exported = neuron.export_shifts()  # refuses quantize=False and exponents beyond int8
        folded = cls(neuron.channels, neuron.k, neuron.dilation, neuron.step_mode, neuron.layout,
                     neuron.method, neuron.backend, neuron.surrogate_function, exported["bias"].dtype)
        folded.load_state_dict(exported)
        return folded.to(exported["bias"].device)

    def to_neuron(self) -> MulFreeChannelwisePSN:
        """A trainable neuron with the same eval output: ``threshold='param'``, ``W = Wq``, ``V_th = -bias``.

        The batch-norm parameters folded away cannot be recovered; training resumes from this point.
        """
        w, b = self.fused_weight_bias()
        neuron = MulFreeChannelwisePSN(self.channels, self.k, self.dilation, quantize=True, threshold="param",
                                       surrogate_function=self.surrogate_function, step_mode=self.step_mode,
                                       backend=self._backend, method=self._method, layout=self._layout)
        neuron = neuron.to(device=b.device, dtype=b.dtype)  # before the copies: a float32 one would round them
        with torch.no_grad():
            neuron.weight.copy_(w)
            neuron.v_threshold.copy_(-b)
        return neuron.train(self.training)

    @property
    def channels(self) -> int:
        return self.shift.shape[0]

    def fused_weight_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sign * 2**shift, bias)`` in the bias dtype: the neuron's ``S = Theta(conv(X, Wq) + b)``."""
        dtype = self.bias.dtype
        return torch.ldexp(self.sign.to(dtype), self.shift.to(dtype)), self.bias

    def export_shifts(self) -> dict[str, torch.Tensor]:
        """Same contract as :meth:`MulFreeChannelwisePSN.export_shifts`."""
        return {"shift": self.shift.clone(), "sign": self.sign.clone(), "bias": self.bias.clone()}

    # ------------------------------------------------------------------ forward
    def _refuse_training(self) -> None:
        if self.training:
            raise RuntimeError("FoldedMulFreePSN is inference-only (it keeps no float weight and no batch "
                               "statistics): call net.eval(), or spikingjelly_mfpsn.deploy.unfold(net) to get "
                               "trainable MulFreeChannelwisePSN neurons back")

    def _mf_psn_args(self) -> dict:
        """The float path: ``Wq`` (already powers of two: no quantiser) and the bias."""
        self._refuse_training()
        w, b = self.fused_weight_bias()
        return {"weight": w, "bias": b, "quantize": None, "training": False}

    def _compute_dtype(self) -> torch.dtype:
        return self.bias.dtype

    def _check_dtype(self, x: torch.Tensor) -> None:
        """Integer arithmetic takes fixed-point integers and floats of any precision (made fixed point)."""
        if self.frac_bits is None:
            super()._check_dtype(x)
        elif not (x.is_floating_point() or x.dtype in _INT_DTYPES):
            raise TypeError(f"x must be a floating-point tensor or a signed fixed-point integer one "
                            f"({', '.join(map(str, _INT_DTYPES))}), got {x.dtype}"
                            + (": an unsigned type, which the int64 arithmetic does not take; convert it with "
                               "x.to(torch.int64)" if str(x.dtype).startswith("torch.uint") else ""))

    def _integer_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` checked and in the fixed-point format (float inputs are rounded to it)."""
        self._check_input(x)
        self._refuse_training()
        if x.dtype in _INT_DTYPES:
            return x.to(torch.int64)
        with self._naming_overflow():
            return to_fixed(x, self.frac_bits)

    def _int_spikes(self, q_seq: torch.Tensor, like: torch.Tensor, layout: str, last: Optional[int] = None,
                    dilation: Optional[int] = None):
        """:func:`int_fire` of ``q_seq`` in the current format, in ``like``'s float dtype (or the default);
        ``dilation``: the neuron's unless given (1 for a sequence of its taps alone)."""
        with self._naming_overflow():
            acc = self._accumulator_bits()
            s = int_fire(q_seq, self.shift, self.sign, int_bias(self.bias, acc),
                         self.dilation if dilation is None else dilation, layout, acc - self.frac_bits, last)
        return s.to(like.dtype if like.is_floating_point() else torch.get_default_dtype())

    def _accumulator_bits(self) -> int:
        """The accumulator's fractional bits in the current format; OverflowError past int64's."""
        if self.acc_frac_bits is not None:
            return self.acc_frac_bits
        acc = exact_acc_frac_bits(self.shift, self.frac_bits)
        if acc > _MAX_BITS:
            raise OverflowError(f"its smallest weight, 2**{int(self.shift.min())}, needs {acc} fractional "
                                f"accumulator bits for exact taps but int64 holds {_MAX_BITS}; lower frac_bits, "
                                f"or pass acc_frac_bits <= {_MAX_BITS} (the smallest taps are then rounded down)")
        return acc

    @contextlib.contextmanager
    def _naming_overflow(self):
        """An OverflowError of the integer path, naming this layer and its format."""
        try:
            yield
        except OverflowError as e:
            where = f"layer {self.layer_name!r}" if self.layer_name else "FoldedMulFreePSN"
            raise OverflowError(f"{where} (integer format: {self.frac_bits} fractional bits): {e}; "
                                f"set_integer(net, calibrate=x) fits the format to the data") from None

    def multi_step_forward(self, x_seq: torch.Tensor) -> torch.Tensor:
        if self.frac_bits is None:
            return super().multi_step_forward(x_seq)
        return self._int_spikes(self._integer_input(x_seq), x_seq, self._layout)

    def single_step_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.frac_bits is None:
            return super().single_step_forward(x)
        self._refuse_time_last_step()
        q = self._integer_input(x)
        queue = self.x_queue
        if queue and (queue[-1].shape != q.shape or queue[-1].dtype != q.dtype):
            raise ValueError(f"single-step x has shape {tuple(x.shape)} but the stored state holds "
                             f"{tuple(queue[-1].shape)} {queue[-1].dtype} inputs; call functional.reset_net(net) "
                             f"before feeding another shape or switching arithmetic")
        keep = self._history_length(queue)
        stored = q.clone() if keep and q is x else q  # (an int64 input: the caller's own tensor)
        if keep and not queue and keep <= PADDED_HISTORY:  # (zeros before the first step, as in float arithmetic)
            queue = (torch.zeros_like(stored),) * keep
        history = queue + (stored,)
        taps = [torch.zeros_like(stored) if t is None else t for t in ops.step_taps(history, self.k, self.dilation)]
        spikes = self._int_spikes(torch.stack(taps), x, "time_first", last=1, dilation=1)[0]  # (its k taps)
        self.x_queue = history[-keep:] if keep > 0 else ()
        return spikes

    def _apply(self, fn, *args, **kwargs):
        # Integer state must not be cast by net.double() / net.half(): only move it (a meta one: see the base's).
        self.x_queue = tuple(t if not t.is_floating_point() or t.is_meta else fn(t) for t in self.x_queue)
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self) -> str:
        arith = "float" if self.frac_bits is None else \
            f"integer(frac_bits={self.frac_bits}, acc_frac_bits={self.acc_frac_bits})"
        return (f"channels={self.channels}, k={self.k}, dilation={self.dilation}, layout={self._layout!r}, "
                f"method={self._method!r}, step_mode={self.step_mode!r}, arithmetic={arith}")


# ---------------------------------------------------------------------------------- network level
def _swap(net: nn.Module, kind: type, convert) -> nn.Module:
    if isinstance(net, kind):
        return convert(net)
    done = {}  # a module used at several places gets one replacement
    for parent, name, child in module_slots(net):  # (every place, not once per module)
        if isinstance(child, kind):
            if id(child) not in done:
                done[id(child)] = convert(child)
            setattr(parent, name, done[id(child)])
    _compat.invalidate_reset_cache(net)
    return net


def fold(net: nn.Module) -> nn.Module:
    """Replace every MulFreeChannelwisePSN of ``net`` by a :class:`FoldedMulFreePSN` (in place).

    Puts ``net`` in eval mode (folding uses the running statistics; a folded net is for inference)
    and returns it, batch norms fused into neurons put back first (``functional.unfuse_batchnorm``); a bare
    neuron returns its folded module. Folded and unfolded eval give the same spikes. Checkpoints: the
    folded net's ``state_dict`` holds int8 ``shift``/``sign`` and ``bias`` per neuron; load it into
    ``fold(build_net())``.
    """
    if not isinstance(net, nn.Module):
        raise TypeError(f"net must be a torch.nn.Module, got {type(net).__name__}")
    folded = {}
    for name, m in net.named_modules():  # (every neuron first: one refused leaves the network as it was)
        if isinstance(m, MulFreeChannelwisePSN):
            try:
                folded[id(m)] = FoldedMulFreePSN.from_neuron(m)
            except ValueError as e:
                raise ValueError(f"cannot fold layer {name or type(net).__name__!r}: {e}") from None
    functional.unfuse_batchnorm(net)
    return _swap(net, MulFreeChannelwisePSN, lambda m: folded[id(m)]).eval()


def unfold(net: nn.Module) -> nn.Module:
    """Replace every FoldedMulFreePSN by a trainable neuron (see :meth:`FoldedMulFreePSN.to_neuron`)."""
    return _swap(net, FoldedMulFreePSN, FoldedMulFreePSN.to_neuron)


def folded_neurons(net: nn.Module) -> list[tuple[str, FoldedMulFreePSN]]:
    """``(name, module)`` of every folded neuron; raises if ``net`` has unfolded MF-PSNs or none at all."""
    unfolded = [n or type(net).__name__ for n, m in net.named_modules() if isinstance(m, MulFreeChannelwisePSN)]
    if unfolded:
        raise ValueError(f"net has MulFreeChannelwisePSN neurons that are not folded ({', '.join(unfolded)}); "
                         f"call spikingjelly_mfpsn.deploy.fold(net) first")
    found = [(n, m) for n, m in net.named_modules() if isinstance(m, FoldedMulFreePSN)]
    if not found:
        raise ValueError("net has no FoldedMulFreePSN: build it with MulFreeChannelwisePSN neurons and call "
                         "spikingjelly_mfpsn.deploy.fold(net)")
    return found


def set_integer(net: nn.Module, frac_bits: Optional[int] = None, acc_frac_bits: Optional[int] = None,
                calibrate=None, headroom_bits: int = 2) -> nn.Module:
    """Run every folded neuron of ``net`` in integer bit-shift arithmetic (see the module docstring).

    Args:
        frac_bits: fractional bits F of the neurons' fixed-point input (float inputs, the synaptic
            layers' outputs, are rounded to this grid on entry; integer inputs are taken as already in it);
            ``None``: per neuron, from ``calibrate`` when given, else :data:`FRAC_BITS`
        acc_frac_bits: accumulator fractional bits; ``None`` picks the exact width per neuron
        calibrate: example input of the network (or a tuple of its positional inputs): each neuron
            gets the widest F whose int64 accumulator holds its inputs on this data with ``headroom_bits``
            to spare (inputs up to ``2**headroom_bits`` times larger still fit; larger ones raise
            ``OverflowError``), and the integer spikes are then compared with the float path's on it:
            any difference is reported with a warning (see :func:`agreement`)

    Clears the neurons' single-step state. Returns ``net``. Raises ``OverflowError`` naming the layer
    where a format cannot hold a neuron's weights (or, with ``calibrate``, its inputs); the neurons
    then keep the arithmetic and formats they had.
    """
    _check_formats(frac_bits, acc_frac_bits)
    if not isinstance(headroom_bits, int) or isinstance(headroom_bits, bool) or not 0 <= headroom_bits <= _MAX_BITS:
        raise ValueError(f"headroom_bits must be an int in [0, {_MAX_BITS}], got {headroom_bits!r}")
    neurons = folded_neurons(net)
    if calibrate is not None:
        _check_multi_step(neurons, "set_integer(calibrate=...)")
    found = {name: (m.frac_bits, m.acc_frac_bits, m.layer_name) for name, m in neurons}
    try:
        formats = {name: frac_bits if frac_bits is not None else FRAC_BITS for name, _ in neurons}
        if calibrate is not None and frac_bits is None:
            tops = _input_magnitudes(net, calibrate, neurons)
            formats = {name: _widest_format(name, m, tops.get(name, 0.0), acc_frac_bits, headroom_bits)
                       for name, m in neurons}
            unseen = [name for name, _ in neurons if not tops.get(name)]
            if unseen:  # (a format fit to no range: larger inputs overflow, and an exported model wraps)
                warnings.warn(f"set_integer: the calibration data gives the folded neurons {', '.join(unseen)} "
                              f"only zero inputs, so their formats are fit to no range; calibrate on real data")
        for name, m in neurons:
            m.frac_bits, m.acc_frac_bits, m.x_queue, m.layer_name = formats[name], acc_frac_bits, (), name
            with m._naming_overflow():
                m._accumulator_bits()
        if calibrate is not None:
            agreement(net, calibrate)  # (warns where the integer spikes differ; leaves the float path set)
    except BaseException:
        for name, m in neurons:
            (m.frac_bits, m.acc_frac_bits, m.layer_name), m.x_queue = found[name], ()
        raise
    for name, m in neurons:
        m.frac_bits, m.acc_frac_bits, m.x_queue = formats[name], acc_frac_bits, ()
    return net


def _run_capturing(net: nn.Module, x, neurons) -> dict[str, list]:
    """Run ``net`` on ``x`` as its neurons are set: ``{name: [(input, spikes) of each call]}``."""
    seen: dict[str, list] = {}
    _compat.functional.reset_net(net)
    run_hooked(net, x, [m.register_forward_hook(lambda mod, inp, out, n=n: seen.setdefault(n, []).append((inp[0], out)))
                        for n, m in neurons])
    return seen


def _input_magnitudes(net: nn.Module, x, neurons) -> dict[str, float]:
    """The largest |input| each folded neuron sees when the float network runs ``x``."""
    set_float(net)
    return {name: max((float(inp.abs().max()) if inp.numel() else 0.0 for inp, _ in calls), default=0.0)
            for name, calls in _run_capturing(net, x, neurons).items()}


def _widest_format(name: str, m: "FoldedMulFreePSN", top: float, acc_frac_bits: Optional[int],
                   headroom_bits: int) -> int:
    """The largest F in [0, 62] for which inputs up to ``top * 2**headroom_bits`` and the bias fit the
    int64 accumulator of neuron ``m`` (the widths :func:`int_charge` and :func:`int_bias` check)."""
    if not math.isfinite(top):
        raise ValueError(f"calibrate: layer {name!r}'s input holds NaN or inf (max |x| = {top})")
    bias_top = float(m.bias.detach().abs().max()) if m.bias.numel() else 0.0
    bias_bits = math.frexp(bias_top)[1] if bias_top > 0 else 0
    for f in range(_MAX_BITS, -1, -1):
        extra = (acc_frac_bits - f) if acc_frac_bits is not None else exact_acc_frac_bits(m.shift, f) - f
        shifts = max(0, int(m.shift.max()) + extra) if m.shift.numel() else 0
        # (the bits of the largest input in format f: rounding may carry it up to the next power of two)
        input_bits = round(math.ldexp(top, headroom_bits + f)).bit_length() if top > 0 else 0
        if input_bits + shifts + m.k.bit_length() <= _MAX_BITS and bias_bits + f + extra < _MAX_BITS \
                and f + extra <= _MAX_BITS:
            return f
    exact = exact_acc_frac_bits(m.shift, 0) if acc_frac_bits is None else None
    if exact is not None and exact >= _MAX_BITS:  # (the weights alone: even F = 0 needs too many bits)
        raise OverflowError(f"calibrate: layer {name!r}: its smallest weight, 2**{int(m.shift.min())}, needs {exact} "
                            f"fractional accumulator bits for exact taps but int64 holds {_MAX_BITS}; pass "
                            f"acc_frac_bits <= {_MAX_BITS} (the smallest taps are then rounded down)")
    if bias_bits + (acc_frac_bits if acc_frac_bits is not None else exact) >= _MAX_BITS:
        raise OverflowError(f"calibrate: layer {name!r}: its folded bias (up to {bias_top:g} in magnitude) does not "
                            f"fit an int64 accumulator with any fixed-point format; such a bias (e.g. from batch-norm "
                            f"running statistics far from the charge) leaves the neuron always or never firing")
    raise OverflowError(f"calibrate: layer {name!r}: inputs up to {top:g} do not fit an int64 accumulator with "
                        f"any fixed-point format" + ("" if acc_frac_bits is not None else
                        f" and exact taps (its weights span 2**{int(m.shift.min())} to 2**{int(m.shift.max())}); "
                        f"pass acc_frac_bits to round the smallest taps down"))


def _check_multi_step(neurons: list, what: str) -> None:
    """ValueError naming the folded neurons in single-step mode: ``what`` runs whole sequences."""
    single = [name for name, m in neurons if m.step_mode != "m"]
    if single:
        raise ValueError(f"{what} runs the network on whole sequences (T, N, ...), and the folded neurons "
                         f"{', '.join(single)} are in step_mode='s': functional.set_step_mode(net, 'm') first "
                         f"(and back to 's' after, to stream)")


def set_float(net: nn.Module) -> nn.Module:
    """Run every folded neuron of ``net`` on the float path again (clears single-step state)."""
    for _, m in folded_neurons(net):
        m.frac_bits, m.acc_frac_bits, m.x_queue = None, None, ()
    return net


def _fractions(module: nn.Module, float_seen: list, seen: list) -> dict[str, float]:
    """``agreement``'s two fractions of one neuron, ``module`` in its integer format: on the float path's
    inputs (``float_seen``, (input, spikes) pairs), and in the whole integer network (``seen``)."""
    local = network = total = 0
    for (inp, out_f), (_, out_i) in zip(float_seen, seen):
        local += int((module(inp) == out_f).sum())
        network += int((out_i == out_f).sum())
        total += out_f.numel()
    return {"local": local / total if total else float("nan"), "network": network / total if total else float("nan")}


@torch.no_grad()
def agreement(net: nn.Module, x, frac_bits: Optional[int] = None,
              acc_frac_bits: Optional[int] = None) -> dict[str, dict[str, float]]:
    """Fraction of spikes on which the integer path equals the float path, per folded neuron.

    ``'local'``: both arithmetics on the same input (the float net's input to that neuron), so it
    isolates the neuron's own rounding; ``'network'``: the whole net run in integer mode against the
    whole net in float mode (differences propagate). Needs multi-step neurons; leaves every neuron in
    the arithmetic and format it found it in (its single-step state cleared). ``x``: the input, or a
    tuple of the network's positional inputs (as autoselect's).
    ``frac_bits``/``acc_frac_bits``: the integer format of every neuron; ``None``: each neuron's own (as
    :func:`set_integer` left it; :data:`FRAC_BITS` where none is set). Any fraction below 1.0 is also
    reported with a warning naming the layers.
    """
    _check_formats(frac_bits, acc_frac_bits)
    neurons = folded_neurons(net)
    # A given frac_bits comes with the given (or the exact) accumulator; each neuron's own format otherwise.
    formats = {n: (frac_bits if frac_bits is not None else m.frac_bits if m.frac_bits is not None else FRAC_BITS,
                   acc_frac_bits if acc_frac_bits is not None or frac_bits is not None else m.acc_frac_bits)
               for n, m in neurons}
    _check_multi_step(neurons, "agreement")
    found = {n: (m.frac_bits, m.acc_frac_bits) for n, m in neurons}
    try:
        set_float(net)
        float_seen = _run_capturing(net, x, neurons)
        for n, m in neurons:
            m.frac_bits, m.acc_frac_bits = formats[n]
        seen = _run_capturing(net, x, neurons)
        result = {name: _fractions(module, float_seen.get(name, []), seen.get(name, [])) for name, module in neurons}
    finally:
        set_float(net)
        for n, m in neurons:
            m.frac_bits, m.acc_frac_bits = found[n]
    differ = {n: r for n, r in result.items() if r["local"] < 1.0 or r["network"] < 1.0}
    if differ:
        warnings.warn("deploy: the integer spikes differ from the float path's on " + ", ".join(
            f"{n or type(net).__name__} (format {formats[n][0]} fractional bits: local {r['local']:.6f}, network "
            f"{r['network']:.6f})" for n, r in differ.items()) + "; set_integer(net, calibrate=x) picks the "
            "widest format per layer", stacklevel=2)
    return result


__all__ = ["FRAC_BITS", "FoldedMulFreePSN", "agreement", "check_fixed", "exact_acc_frac_bits", "fold",
           "folded_neurons", "from_fixed", "int_bias", "int_charge", "int_fire", "set_float", "set_integer",
           "tap_schedule", "to_fixed", "unfold"]
