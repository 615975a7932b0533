"""The input filter: normalized text against a dictionary (one Aho-Corasick automaton for every rule's
words) and each rule's regular expressions, in front of the tokenizer.

Regular expressions run only where they can match: each one's leading literals (every match of
`\b(ignore|disregard) ...` begins with "ignore" or "disregard") go into a second automaton, and the
expression is tried (`match`, anchored) only at the places one of them occurs. A 4,000-character
prompt thus costs one pass per automaton plus a few anchored matches, not a scan per expression.

A request is refused when a `block` rule matches; `flag` rules are counted and logged; `redact`
rules replace what they matched, found again in a character-mapped normalization so the span in the
original text is exact. The same filter checks generated text (the output guard).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from re import _constants as sre_constants
from re import _parser as sre_parser

import ahocorasick

from llmaccel.safety.normalize import normalize, normalize_with_offsets
from llmaccel.safety.rules import Action, Rule


@dataclass(frozen=True)
class RuleMatch:
    rule: Rule
    terms: tuple[str, ...]  # the words, and the text each pattern matched

    def describe(self) -> str:
        shown = ", ".join(repr(t) for t in self.terms[:3]) + (", ..." if len(self.terms) > 3 else "")
        return f"rule {self.rule.id!r} (matched {shown})"


@dataclass(frozen=True)
class FilterResult:
    text: str  # the input, with redactions applied if any
    matches: tuple[RuleMatch, ...] = ()

    @property
    def blocked_by(self) -> RuleMatch | None:
        return next((m for m in self.matches if m.rule.action is Action.BLOCK), None)


def _is_word_char(char: str) -> bool:
    return char.isascii() and (char.isalnum() or char == "_")


def leading_literals(pattern: re.Pattern) -> set[str] | None:
    """Strings one of which starts every match of `pattern`, or None when it has no such set."""
    return _leading(list(sre_parser.parse(pattern.pattern, pattern.flags)))


def _leading(items: list) -> set[str] | None:
    index = 0
    while index < len(items) and items[index][0] is sre_constants.AT:  # \b and the like take no characters
        index += 1
    if index == len(items):
        return None
    op, arg = items[index]
    if op is sre_constants.LITERAL:
        chars = []
        while index < len(items) and items[index][0] is sre_constants.LITERAL:
            chars.append(chr(items[index][1]))
            index += 1
        return {"".join(chars)}
    if op is sre_constants.SUBPATTERN:
        return _leading(list(arg[3]))
    if op is sre_constants.BRANCH:
        out: set[str] = set()
        for branch in arg[1]:
            found = _leading(list(branch))
            if found is None:
                return None
            out |= found
        return out
    return None


def _automaton(keys) -> ahocorasick.Automaton | None:
    automaton = ahocorasick.Automaton()
    for key in keys:
        automaton.add_word(key, key)
    if len(automaton) == 0:
        return None
    automaton.make_automaton()
    return automaton


class InputFilter:
    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self._words_to_rules: dict[str, list[int]] = {}
        self._triggers: dict[str, list[tuple[int, int]]] = {}  # leading literal -> (rule, pattern)
        self._unanchored: list[tuple[int, int]] = []  # patterns with no leading literals: searched
        for index, rule in enumerate(rules):
            for word in rule.words:
                self._words_to_rules.setdefault(word, []).append(index)
            for number, pattern in enumerate(rule.patterns):
                literals = leading_literals(pattern)
                if not literals:
                    self._unanchored.append((index, number))
                for literal in literals or ():
                    self._triggers.setdefault(literal, []).append((index, number))
        self._word_automaton = _automaton(self._words_to_rules)
        self._trigger_automaton = _automaton(self._triggers)
        self._redacts = any(rule.action is Action.REDACT for rule in rules)

    def check(self, text: str) -> FilterResult:
        normalized = normalize(text)
        found: list[dict[str, None]] = [{} for _ in self.rules]  # ordered sets of matched terms
        for word, _, _ in self._word_spans(normalized):
            for index in self._words_to_rules[word]:
                found[index][word] = None
        for index, _, match in self._pattern_matches(normalized):
            found[index][match.group().strip()] = None
        matches = tuple(RuleMatch(rule, tuple(terms)) for rule, terms in zip(self.rules, found, strict=True)
                        if len(terms) >= rule.min_matches)
        if self._redacts and any(m.rule.action is Action.REDACT for m in matches):
            text = self._redact(text, [m.rule for m in matches if m.rule.action is Action.REDACT])
        return FilterResult(text, matches)

    def _pattern_matches(self, text: str):
        """(rule, pattern, first match) of every pattern that matches `text`."""
        done: set[tuple[int, int]] = set()
        if self._trigger_automaton is not None:
            for last, literal in self._trigger_automaton.iter(text):
                for key in self._triggers[literal]:
                    if key not in done:
                        match = self.rules[key[0]].patterns[key[1]].match(text, last - len(literal) + 1)
                        if match:
                            done.add(key)
                            yield key[0], key[1], match
        for index, number in self._unanchored:
            match = self.rules[index].patterns[number].search(text)
            if match:
                yield index, number, match

    def _word_spans(self, text: str):
        """(word, start, end) of every dictionary word found as a whole word."""
        if self._word_automaton is None:
            return
        for last, word in self._word_automaton.iter(text):
            start, end = last - len(word) + 1, last + 1
            if _is_word_char(word[0]) and start > 0 and _is_word_char(text[start - 1]):
                continue
            if _is_word_char(word[-1]) and end < len(text) and _is_word_char(text[end]):
                continue
            yield word, start, end

    def spans(self, text: str, rules: list[Rule]) -> list[tuple[int, int]]:
        """(start, end) in `text` of every match of these rules' words and patterns, in order."""
        return [(start, end) for start, end, _ in self.rule_spans(text, rules)]

    def rule_spans(self, text: str, rules: list[Rule]) -> list[tuple[int, int, Rule]]:
        """As `spans`, with the rule of each match."""
        normalized, offsets = normalize_with_offsets(text)
        found = []
        for word, start, end in self._word_spans(normalized):
            found += [(start, end, r) for r in rules if word in r.words]
        for rule in rules:
            found += [(m.start(), m.end(), rule) for p in rule.patterns for m in p.finditer(normalized)
                      if m.end() > m.start()]
        # map back to the original characters
        return sorted(((offsets[start], offsets[end - 1] + 1, rule) for start, end, rule in found),
                      key=lambda span: span[:2])

    def _redact(self, text: str, rules: list[Rule]) -> str:
        out, last = [], 0
        for begin, finish, rule in self.rule_spans(text, rules):
            if begin < last:  # overlaps the previous span: extend it
                last = max(last, finish)
                continue
            out += [text[last:begin], rule.replacement]
            last = finish
        out.append(text[last:])
        return "".join(out)
