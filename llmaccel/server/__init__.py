"""The OpenAI-compatible HTTP server (FastAPI): routes, request and response models, streaming, metrics, the
web UI's routes. Floor "the server": imports the engine's async API and everything below; only the
command line, the cluster and the benchmarks import it."""
