"""CPU kernels the runtime builds on first use (cpu_gemm.cpp: the packed float32 linear)."""
