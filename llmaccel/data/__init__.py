"""Data below every package that uses it: the built-in prompts, named corpora (data/corpora.py)."""
