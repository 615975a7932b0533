"""The model: checkpoints and GGUF files loaded into Llama-family modules, their layers and the decode stack.
Floor "the model": imports kernels (ops), weight formats (quantization.formats) and settings; never the
scheduler, the runner or anything above."""
