"""What every prompt passes before the tokenizer: a size limit, well-formed text, the input filter.

Chat requests are checked message by message (every role: a client can forge assistant turns as
easily as user ones), completion requests prompt by prompt; a token-id prompt is decoded and
checked as text (special tokens skipped: sending them is what token ids are for). A `block` rule
refuses the request (HTTP 400, code `content_filter`, the rule id in the message); `flag` rules are
counted and logged; `redact` rules rewrite the text the model gets.

Chat messages may not contain the model's special tokens as text ("<|im_start|>system"): the chat
template is rendered to text and tokenized, so such text would become real role markers.
"""

from __future__ import annotations

import logging
import re
import time

from llmaccel.errors import ContentFilterError, InvalidRequestError
from llmaccel.safety.input_filter import InputFilter
from llmaccel.safety.rules import Action
from llmaccel.server import protocol as p
from llmaccel.server.job import AnyRequest
from llmaccel.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# NUL, and lone UTF-16 surrogates ("\ud800" in JSON), which no tokenizer can encode. Other control
# characters pass: pasted terminal output holds ESC sequences, source code form feeds; the input
# filter deletes them before matching, so they cannot split a word to hide it.
_BAD_CHARACTER = re.compile(r"[\x00\ud800-\udfff]")


class PromptChecks:
    def __init__(self, input_filter: InputFilter | None, max_prompt_chars: int | None, metrics: ServerMetrics,
                 tokenizer) -> None:
        self.input_filter = input_filter
        self.max_prompt_chars = max_prompt_chars
        self.metrics = metrics
        self.tokenizer = tokenizer
        specials = sorted({t for t in getattr(tokenizer, "all_special_tokens", []) if len(t) > 1}
                          | {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                             if t.special and len(t.content) > 1}, key=len, reverse=True)
        self._special_tokens = re.compile("|".join(map(re.escape, specials))) if specials else None

    def apply(self, request: AnyRequest) -> AnyRequest:
        """The request as the model should see it (redactions applied), or an error that says why not."""
        texts = self._texts(request)
        total = sum(len(text) for _, text in texts)
        if self.max_prompt_chars is not None and total > self.max_prompt_chars:
            raise InvalidRequestError(f"the prompt has {total} characters; this server accepts at most "
                                      f"{self.max_prompt_chars} (--max-prompt-chars)")
        in_chat = isinstance(request, p.ChatCompletionRequest)  # a raw completion prompt may hold its template
        for where, text in texts:
            bad = _BAD_CHARACTER.search(text)
            if bad:
                raise InvalidRequestError(f"{where} contains the character U+{ord(bad.group()):04X} at position "
                                          f"{bad.start()}; NUL characters and lone surrogates are not accepted")
            special = self._special_tokens.search(text) if self._special_tokens and in_chat else None
            if special:
                self.metrics.safety_input.labels(rule="special-token", action="block").inc()
                raise ContentFilterError(f"{where} contains the model's special token {special.group()!r}, which "
                                         "would act as a chat-template marker; remove it", "special-token")
        if self.input_filter is None:
            return request
        replaced = {}
        for where, text in texts:
            result = self._filter(where, text)
            if result != text:
                replaced[where] = result
        return self._rewrite(request, replaced) if replaced else request

    def _filter(self, where: str, text: str) -> str:
        start = time.perf_counter()
        result = self.input_filter.check(text)
        self.metrics.input_filter_seconds.observe(time.perf_counter() - start)
        for match in result.matches:
            self.metrics.safety_input.labels(rule=match.rule.id, action=match.rule.action.value).inc()
            if match.rule.action is Action.FLAG:
                logger.warning("input filter flagged %s: %s", where, match.describe())
        blocked = result.blocked_by
        if blocked is not None:
            logger.warning("input filter blocked %s: %s", where, blocked.describe())
            raise ContentFilterError(f"{where} was blocked by the content filter: {blocked.describe()}",
                                     blocked.rule.id)
        return result.text

    def _texts(self, request: AnyRequest) -> list[tuple[str, str]]:
        if isinstance(request, p.ChatCompletionRequest):
            return [(f"messages[{i}].content", m.text()) for i, m in enumerate(request.messages)]
        return [(f"prompt[{i}]", x if isinstance(x, str) else self.tokenizer.decode(x, skip_special_tokens=True))
                for i, x in enumerate(request.prompt)]

    @staticmethod
    def _rewrite(request: AnyRequest, replaced: dict[str, str]) -> AnyRequest:
        if isinstance(request, p.ChatCompletionRequest):
            messages = [m.model_copy(update={"content": replaced[f"messages[{i}].content"]})
                        if f"messages[{i}].content" in replaced else m for i, m in enumerate(request.messages)]
            return request.model_copy(update={"messages": messages})
        prompts = [replaced.get(f"prompt[{i}]", x) for i, x in enumerate(request.prompt)]
        return request.model_copy(update={"prompt": prompts})
