"""Weight-only quantization: formats, quantize, calibrate, evaluate."""
