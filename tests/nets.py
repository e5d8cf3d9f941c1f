"""Small wrapper networks the tests share."""
from torch import nn


class Gained(nn.Module):
    """A network of two inputs: ``body(x * gain)``, a sequence and a gain (a number, a ``(1,)`` tensor
    or a mask shaped like the sequence)."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x, gain):
        return self.body(x * gain)
