"""Weight-only quantization. Two floors: formats.py, prequantized.py and quality.py are "weight formats and data"
(the model and ops build on them); the tools that run the engine to quantize or measure a model
(checkpoint.py, perplexity.py, awq.py) sit on "tools that drive the engine", above the Python API."""
