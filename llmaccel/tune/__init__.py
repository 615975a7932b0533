"""`llmaccel tune`: SLO-driven search over the serving flags (drives bench/ from above; serving never imports it)."""
