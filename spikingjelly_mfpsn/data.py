"""Moved to :mod:`spikingjelly_mfpsn.paper.data`; this name keeps working."""
from .paper.data import *  # noqa: F401,F403
from .paper.data import __all__  # noqa: F401
