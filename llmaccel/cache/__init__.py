"""Caches above the engine: the exact result cache."""
