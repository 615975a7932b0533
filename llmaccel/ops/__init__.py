"""Compute kernels that know nothing of requests: the C++ CPU kernels and their loader, attention, quantized
linears, the kernel choice. Floor "kernels": imports weight formats, settings and leaves (platform) only."""
