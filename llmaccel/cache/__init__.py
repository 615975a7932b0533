"""The exact result cache (memory LRU + SQLite): whole answers kept above the engine. Its floor is "weight
formats and data": it imports only settings and leaves (outputs, sampling_params); the server uses it."""
