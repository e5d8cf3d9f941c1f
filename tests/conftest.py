import os
import sys

# The Triton kernels run on the CPU through Triton's interpreter; it is chosen when the kernels are
# defined, so this must happen before spikingjelly_mfpsn (and with it triton) is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))
