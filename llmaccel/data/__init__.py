"""Data below every package that uses it: the built-in prompts, named corpora (data/corpora.py). Floor "weight
formats and data": imports settings (config) and the wheel's data paths only."""
