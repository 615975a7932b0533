"""Replicas on Ray Serve: engine replicas, a cache-aware router, one OpenAI-compatible ingress.

Nothing in the serving path imports this package; `llmaccel serve --replicas N` and
`serve run llmaccel.cluster.deployment:build_app` do, and only they import Ray. Floor "tools that
drive the engine": imports the server, the engine and everything below.
"""
