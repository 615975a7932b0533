"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar."""
