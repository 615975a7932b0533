"""Speculative decoding: drafters propose tokens, the target model verifies them in one pass. Floor "a step":
imports the runner, the scheduler's types, the model and kernels; the engine builds it."""
