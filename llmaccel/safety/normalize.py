"""Text normalization in front of the filter rules, so obfuscated text matches like plain text.

Steps, in order:
1. Unicode NFKC: full-width letters and digits become ASCII ("Ｉｇｎｏｒｅ" -> "Ignore"), ligatures
   and other compatibility forms their plain letters.
2. Invisible characters are deleted (zero-width spaces and joiners, soft hyphens, bidi controls,
   Unicode tag characters, variation selectors, C0/C1 controls); tabs and newlines become spaces.
   Common Cyrillic and Greek look-alikes of Latin letters become those letters.
3. Case folding (a stronger lower(): "ß" -> "ss").
4. Letters spaced or punctuated apart are joined: "i g n o r e", "i.g.n.o.r.e" and "i-g-n-o-r-e"
   become "ignore" (a run of at least three single characters); within such a run a separator
   other than the usual one ("a l l   r u l e s": three spaces against one) marks a word gap and
   becomes a space. Hyphens inside a word go
   ("li-mitations" -> "limitations", so "role-play" reads "roleplay"). Spaces between two Chinese or
   Japanese characters are dropped ("忽 略" -> "忽略"): those scripts put none between words.
5. Runs of whitespace become one space.

`normalize` returns the text; `normalize_with_offsets` also returns, for each output character, the
index of the input character it came from, so a match can be mapped back (for redaction).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

_INVISIBLE = ([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0), 0xAD, 0x034F, 0x061C,
               0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, *range(0x200B, 0x2010), *range(0x202A, 0x202F),
               *range(0x2060, 0x2070), 0x3164, *range(0xFE00, 0xFE10), 0xFEFF, 0xFFA0, *range(0xE0000, 0xE0080)])
_LOOKALIKES = {  # Cyrillic and Greek letters drawn like Latin ones (after case folding)
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p", "с": "c", "т": "t",
    "у": "y", "х": "x", "ѕ": "s", "і": "i", "ї": "i", "ј": "j", "ԁ": "d", "ԛ": "q", "ԝ": "w", "һ": "h",
    "α": "a", "β": "b", "ε": "e", "ι": "i", "κ": "k", "ν": "v", "ο": "o", "ρ": "p", "τ": "t", "υ": "u", "χ": "x",
}
_TABLE = {cp: None for cp in _INVISIBLE} | {ord("\t"): " ", ord("\n"): " ", ord("\r"): " "}
_TABLE |= {ord(k): v for k, v in _LOOKALIKES.items()} | {ord(k.upper()): v for k, v in _LOOKALIKES.items()}
# three or more single characters, each followed by separators (spaces or punctuation)
_SPACED = re.compile(r"(?<![^\W_])(?:[^\W_][\s.\-_*·•|/\\,:;~+]+){2,}[^\W_](?![^\W_])")
_SEPARATOR = re.compile(r"[\s.\-_*·•|/\\,:;~+]+")
_INNER_HYPHEN = re.compile(r"(?<=[^\W\d_])-+(?=[^\W\d_])")
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK_GAP = re.compile(f"(?<=[{_CJK}])\\s+(?=[{_CJK}])")
_WHITESPACE = re.compile(r"\s{2,}")


def _fold(text: str) -> str:
    return unicodedata.normalize("NFKC", text).translate(_TABLE).casefold()


def _join_spaced(run: str) -> list[tuple[str, int]]:
    """(character, index in run) to keep of a spaced-out run: its letters, and a space for each
    separator that is not the run's most common one (the word gaps)."""
    separators = [(m.start(), m.group()) for m in _SEPARATOR.finditer(run)]
    texts = [sep for _, sep in separators]
    usual = max(set(texts), key=texts.count)
    kept, last = [], 0
    for start, sep in separators:
        kept += [(run[i], i) for i in range(last, start)]
        if sep != usual:
            kept.append((" ", start))
        last = start + len(sep)
    return kept + [(run[i], i) for i in range(last, len(run))]


def normalize(text: str) -> str:
    text = _SPACED.sub(lambda m: "".join(c for c, _ in _join_spaced(m.group())), _fold(text))
    return _WHITESPACE.sub(" ", _CJK_GAP.sub("", _INNER_HYPHEN.sub("", text)))


def normalize_with_offsets(text: str) -> tuple[str, list[int]]:
    """The same steps character by character, keeping where each output character came from.
    (NFKC of single characters does not compose combining sequences, so the text may differ from
    `normalize` there; matches found in it still map back exactly.)"""
    pieces, offsets = [], []
    for index, char in enumerate(text):
        folded = _fold(char)
        pieces.append(folded)
        offsets += [index] * len(folded)
    folded = "".join(pieces)
    folded, offsets = _rewrite(folded, offsets, _SPACED, lambda m: _join_spaced(m.group()))
    folded, offsets = _rewrite(folded, offsets, _INNER_HYPHEN, lambda m: [])
    folded, offsets = _rewrite(folded, offsets, _CJK_GAP, lambda m: [])
    return _rewrite(folded, offsets, _WHITESPACE, lambda m: [(" ", 0)])


def _rewrite(text: str, offsets: list[int], pattern: re.Pattern,
             keep: Callable[[re.Match], list[tuple[str, int]]]) -> tuple[str, list[int]]:
    """Replace each match of `pattern` by the (character, position within the match) `keep` gives."""
    out_text, out_offsets, last = [], [], 0
    for match in pattern.finditer(text):
        out_text.append(text[last:match.start()])
        out_offsets += offsets[last:match.start()]
        kept = keep(match)
        out_text.append("".join(char for char, _ in kept))
        out_offsets += [offsets[match.start() + i] for _, i in kept]
        last = match.end()
    out_text.append(text[last:])
    out_offsets += offsets[last:]
    return "".join(out_text), out_offsets
