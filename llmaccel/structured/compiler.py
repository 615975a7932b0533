"""Grammars for the engine: compiled once per constraint, a matcher per sample, masks per step.

llguidance (PyPI `llguidance`, no dependencies) computes the set of tokens a grammar allows next
as a bitmask, lazily, from a lexer and an Earley parser over the tokenizer's token trie. xgrammar
fills a mask faster (0.07 ms against 0.47 ms for 32 matchers walking a nested schema at random, in a
probe) but on Linux it requires triton, a GPU compiler of hundreds of MB, for a CPU server. Here the
fill costs about 0.5 ms a step for 32 constrained requests of 64 (docs/benchmarks.md, "Structured
outputs"), and the mask is applied by llmaccel's own C++ kernel. A step's masks are filled for the
whole batch in one call on llguidance's threads (as many as torch's), which release the GIL: on a
GPU the runner overlaps them with the forward pass, on a CPU it fills them just before it, since
there the forward pass has every core already (`bench structured` measured both). A request's
matcher advances by the tokens the engine kept; drafted tokens are masked by a matcher that steps
through them and rolls back (LLExecutor's draft-token call). A fresh matcher per constraint is kept
and copied for each new request (a copy: 1 us; building one: 0.4 ms for a nested schema).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import torch

from llmaccel.errors import InvalidRequestError
from llmaccel.structured.params import KIND_NAMES, StructuredOutputsParams

COMPILED_CACHE = 256  # distinct constraints whose compiled, fresh matcher is kept


class GrammarMatcher:
    """One sample's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance by tokens the engine kept. Raises RuntimeError if the grammar refuses one (it was
        masked, so only a bug gets here)."""
        if token_ids and not self.matcher.consume_tokens(list(token_ids)):
            raise RuntimeError(f"the grammar refused a generated token: {self.matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The output is complete: the grammar allows no token but EOS."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """The tokenizer as llguidance reads it (built at the first constrained request, ~0.3 s), the
    grammars validated so far, and the executor that fills a batch's masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.mask_words = (vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._fresh_matchers: OrderedDict[StructuredOutputsParams, llguidance.LLMatcher] = OrderedDict()
        self.fill_seconds = 0.0  # time spent filling masks, and in how many steps (bench structured reads them)
        self.fill_calls = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                                  eos_token=list(self.eos_token_ids))
                # as many threads as torch's: the masks are filled between forward passes on a CPU
                self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
            return self._ll_tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError naming the field when the constraint cannot be compiled (or matches
        only the empty output); the compiled matcher is kept for the request's samples."""
        self._fresh(params)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self._fresh(params).deep_copy())

    def _fresh(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        with self._lock:
            fresh = self._fresh_matchers.get(params)
            if fresh is not None:
                self._fresh_matchers.move_to_end(params)
                return fresh
        fresh = llguidance.LLMatcher(self.tokenizer, self._grammar(params), log_level=0)
        if fresh.is_error():
            raise InvalidRequestError(f"{params.source}: {fresh.get_error()}", param=params.source)
        if self._allows_only_eos(fresh):  # nothing to generate: not even min_tokens could be honoured
            raise InvalidRequestError(f"{params.source}: the {KIND_NAMES[params.kind]} matches only the empty "
                                      "output; give one that allows some text", param=params.source)
        with self._lock:
            self._fresh_matchers[params] = fresh
            while len(self._fresh_matchers) > COMPILED_CACHE:
                self._fresh_matchers.popitem(last=False)
        return fresh

    def _allows_only_eos(self, fresh: llguidance.LLMatcher) -> bool:
        probe = fresh.deep_copy()
        if probe.is_stopped():
            return True
        mask = torch.frombuffer(bytearray(probe.compute_bitmask()), dtype=torch.int32)[None]
        allowed = unpack_masks(mask, self.vocab_size)[0]
        allowed[list(self.eos_token_ids)] = False
        return not bool(allowed.any())

    def _grammar(self, params: StructuredOutputsParams) -> str:
        try:
            return _validated(params, self.tokenizer)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param=params.source) from None

    def fill(self, requests: Sequence[tuple[GrammarMatcher, int, list[int]]], num_rows: int) -> torch.Tensor:
        """[num_rows, mask_words] int32 bitmasks: for each (matcher, row, drafts), the mask at its place
        in `row` and the mask after each draft token it allows in the rows after that."""
        began = time.perf_counter()
        mask = torch.full((num_rows, self.mask_words), -1, dtype=torch.int32)
        self.tokenizer  # noqa: B018 (builds the executor too)
        plain = [(m.matcher, row) for m, row, drafts in requests if not drafts]
        drafted = [(m.matcher, row, list(drafts)) for m, row, drafts in requests if drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), self.mask_words * 4, num_rows)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, mask.data_ptr(), self.mask_words * 4,
                                                                    num_rows)
        self.fill_seconds += time.perf_counter() - began
        self.fill_calls += 1
        return mask


def _validated(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> str:
    """The grammar text of a constraint, checked against the tokenizer. Raises ValueError naming the problem."""
    grammar = params.grammar_text()
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"{params.source}: the {KIND_NAMES[params.kind]} is invalid: "
                         f"{messages[0].strip().splitlines()[0]}")
    return grammar


_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def unpack_masks(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, words] int32 bitmasks -> [B, vocab_size] bool, True where the token is allowed."""
    return ((masks[:, :, None] & _BITS) != 0).reshape(masks.shape[0], -1)[:, :vocab_size]
