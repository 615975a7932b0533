"""The engine: requests, KV blocks, the scheduler's one token-budget rule and the step loop.

Two floors live here (tests/test_import_graph.py): requests, the block pool, the KV cache manager and the
scheduler sit on "scheduling and sampling", under the runner and speculative decoding; engine.py (LLMEngine,
with loading.py, scoring.py, step_update.py) sits on "the engine", above them; async_engine.py and its thread
and request streams on "the Python API and the engine's thread". The engine never imports the server."""
