// The kernels of mfpsn_cpu.cpp for float64.
#include "mfpsn_cpu.cpp"

MFPSN_INSTANTIATE(double)
