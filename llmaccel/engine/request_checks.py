"""What the engine refuses before it queues a request: an empty prompt, one that leaves no room to
generate, token ids outside the vocabulary, a grammar that does not compile. Plain functions of the
model's facts, so a replicated server's ingress (cluster/remote_engine.py) runs the same checks
without an engine of its own.
"""

from __future__ import annotations

from llmaccel.bounds import check_token_ids
from llmaccel.errors import InvalidRequestError, PromptTooLongError
from llmaccel.sampling_params import SamplingParams
from llmaccel.structured.compiler import GrammarCompiler


def check_prompt(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not token_ids:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    if len(token_ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(token_ids)} tokens, but max_model_len is {max_model_len} "
            f"(prompt plus at least one generated token must fit); shorten the prompt")
    check_token_ids(token_ids, vocab_size, "prompt", param="prompt")


def check_request(token_ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                  grammars: GrammarCompiler) -> None:
    """What the engine refuses before queueing: a bad prompt, token ids outside the vocabulary, a
    grammar that does not compile. Also run by a replicated server's ingress, before any replica."""
    check_prompt(token_ids, max_model_len, vocab_size)
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids", param="stop_token_ids")
    for token, _ in params.logit_bias:
        if token >= vocab_size:
            raise InvalidRequestError(f"logit_bias: token id {token} is outside the vocabulary "
                                      f"[0, {vocab_size})", param="logit_bias")
    if params.structured_outputs is not None:
        grammars.check(params.structured_outputs)
