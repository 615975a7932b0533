"""Benchmarks: offline (vs HF transformers) and, later, serving."""
