"""Structured outputs: a request's output held to a JSON schema, a regex, a choice or a grammar. Floor "leaves":
it imports only errors, so settings (config, sampling_params) can name its parameters."""
