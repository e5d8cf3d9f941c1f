// The kernels of mfpsn_cpu.cpp for float32.
#include "mfpsn_cpu.cpp"

MFPSN_INSTANTIATE(float)
