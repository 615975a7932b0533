"""Benchmarks (`llmaccel bench ...`): the load generator, llmaccel against HF transformers and its peers, and
the reports (tables, plots, the headline of docs/benchmarks.md). The floor under the command line: it may
import everything below it (server, engine, cluster, model, ...); nothing but cli.py imports it."""
