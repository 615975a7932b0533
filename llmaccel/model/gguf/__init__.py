"""GGUF files read in place: the reader (metadata and tensor table, memory-mapped), the tensor types' block
layouts (quants.py), llama.cpp's names against HF's (names.py), the tensors as the model's weights in
llmaccel's kernel formats (weights.py), the checkpoint (checkpoint.py), and the converted HF directory for
what needs float weights on disk (convert.py). On the model's floor; a quantized file is never expanded."""
