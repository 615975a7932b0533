"""Compute kernels that know nothing of requests."""
