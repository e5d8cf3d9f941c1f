"""Moved to :mod:`spikingjelly_mfpsn.paper.models`; this name keeps working."""
from .paper.models import *  # noqa: F401,F403
from .paper.models import __all__  # noqa: F401
