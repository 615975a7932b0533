"""A completion's `echo` and `prompt_logprobs`, in the shapes of OpenAI's legacy completions and vLLM
(`shapes`: the server's Shapes, server/shapes.py: its tokenizer and token texts).

`echo`: each choice's text starts with its prompt (a token-id prompt as its decoded text); with
`logprobs`, the prompt's tokens lead the choice's logprobs, the first with null logprobs (nothing
comes before it), as OpenAI answered. `prompt_logprobs` (vLLM's extra): per prompt token, null for
the first, else {token id: {logprob, rank, decoded_token}} for the token and the top N there.
"""

from __future__ import annotations

from llmaccel.outputs import Logprob
from llmaccel.server.response_models import CompletionLogprobs


def prompt_text(shapes, job, i: int) -> str:
    """Prompt i of a completion job as text."""
    prompt = job.request.prompt[i]
    return prompt if isinstance(prompt, str) else shapes.tokenizer.decode(prompt)


def echo_logprobs(shapes, job, i: int, entries: list[Logprob | None] | None) -> CompletionLogprobs:
    """The prompt's part of an echoed choice's logprobs: its tokens, the first one's logprob null."""
    prompt = job.prompt_ids[i]
    known = entries if entries is not None else []
    return shapes.completion_entries([(token, known[position] if position < len(known) else None)
                                      for position, token in enumerate(prompt)])


def joined(head: CompletionLogprobs, tail: CompletionLogprobs | None) -> CompletionLogprobs:
    """`tail` after `head`, its text offsets moved past head's text."""
    if tail is None:
        return head
    start = head.text_offset[-1] + len(head.tokens[-1]) if head.tokens else 0
    return CompletionLogprobs(tokens=head.tokens + tail.tokens,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + [start + o for o in tail.text_offset])


def prompt_logprobs_field(shapes, entries: list[Logprob | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then the token's and the top N's entries."""
    if entries is None:
        return None
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: (entry.logprob, entry.rank)}
        for place, (token_id, value) in enumerate(entry.top.items(), start=1):
            ranked.setdefault(token_id, (value, place))
        out.append({str(token_id): {"logprob": value, "rank": rank, "decoded_token": shapes.token_text(token_id)}
                    for token_id, (value, rank) in ranked.items()})
    return out
