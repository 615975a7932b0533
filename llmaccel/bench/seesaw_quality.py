"""The quality half of `bench seesaw`: questions with known answers, and the scorers.

Three sets, all offline:
- `trivia`: chatterbot-corpus's 260 English trivia questions and answers (BSD), asked through the chat
  template; right when the answer's normalized words appear in the reply's.
- `cloze-en`: Wikipedia passages (gensim's test articles) cut just before a sentence's last word where that word
  is a name or a number (a fact the text states); right when the continuation's first word is it.
- `cloze-zh`: Romance of the Three Kingdoms passages cut just before a principal character's name; right when the
  continuation starts with it.
Diversity under sampling: distinct-n (the share of n-grams that are distinct, over a prompt's samples) and
self-BLEU (each sample's BLEU-4 against the prompt's other samples; lower is more diverse), both on token ids
so that Chinese and English count alike.
"""

from __future__ import annotations

import math
import random
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

import yaml

from llmaccel.data.corpora import load_corpus
from llmaccel.wheel_data import wheel_file


@dataclass(frozen=True)
class Question:
    prompt: str  # the question (chat) or the passage to continue (completion)
    answers: tuple[str, ...]
    kind: str  # "trivia", "cloze-en" or "cloze-zh"

    @property
    def chat(self) -> bool:
        return self.kind == "trivia"


def normalize_words(text: str) -> list[str]:
    """Lower case, NFKC, punctuation and the articles a/an/the dropped: SQuAD's answer normalization."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text)
    return [w for w in text.split() if w not in ("a", "an", "the")]


def contains_answer(reply: str, answers: tuple[str, ...]) -> bool:
    """Whether any answer's normalized words appear, in order and adjacent, among the reply's."""
    words = normalize_words(reply)
    for answer in answers:
        target = normalize_words(answer)
        if target and any(words[i:i + len(target)] == target for i in range(len(words) - len(target) + 1)):
            return True
    return False


def cloze_correct(continuation: str, answers: tuple[str, ...], chinese: bool = False) -> bool:
    """English: the continuation's first word is the answer. Chinese: the continuation starts with it."""
    if chinese:
        text = "".join(c for c in unicodedata.normalize("NFKC", continuation) if not c.isspace())
        return any(text.startswith(a) for a in answers)
    words = normalize_words(continuation)
    return bool(words) and any(words[0] == normalize_words(a)[0] for a in answers if normalize_words(a))


def score(question: Question, reply: str) -> bool:
    if question.kind == "trivia":
        return contains_answer(reply, question.answers)
    return cloze_correct(reply, question.answers, chinese=question.kind == "cloze-zh")


def trivia_questions() -> list[Question]:
    raw = wheel_file("chatterbot-corpus==1.3.3", "chatterbot_corpus/data/english/trivia.yml")
    pairs = yaml.safe_load(raw)["conversations"]
    return [Question(str(q), (str(a),), "trivia") for q, a, *_ in pairs]


_FACT_WORD = re.compile(r"^(?:[A-Z][a-z]+|\d{3,4})$")


def cloze_en(count: int, seed: int = 0, context_words: int = 120) -> list[Question]:
    """Passages ending just before a sentence's last word, where that word is a name or a year-like number."""
    words = load_corpus("enwiki").split()
    rng = random.Random(seed)
    candidates = [i for i in range(context_words, len(words))
                  if words[i].endswith(".") and _FACT_WORD.match(words[i][:-1]) and not words[i - 1].endswith(".")]
    chosen = sorted(rng.sample(candidates, min(count, len(candidates))))
    return [Question(" ".join(words[i - context_words:i]), (words[i][:-1],), "cloze-en") for i in chosen]


SANGUO_NAMES = ("孔明", "玄德", "曹操", "关公", "张飞", "云长", "孙权", "周瑜", "司马懿", "赵云", "吕布", "袁绍",
                "董卓", "刘备", "姜维", "魏延", "马超", "黄忠", "鲁肃", "孟获", "曹丕", "孙策", "张辽", "邓艾")


def cloze_zh(count: int, seed: int = 0, context_chars: int = 200) -> list[Question]:
    """Passages cut just before a principal character's name that the passage has already named."""
    text = load_corpus("sanguo")
    pattern = re.compile("|".join(SANGUO_NAMES))
    rng = random.Random(seed)
    spots = [m for m in pattern.finditer(text, context_chars)
             if m.group() in text[m.start() - context_chars:m.start()]]
    chosen = sorted(rng.sample(spots, min(count, len(spots))), key=lambda m: m.start())
    return [Question(text[m.start() - context_chars:m.start()], (m.group(),), "cloze-zh") for m in chosen]


def question_sets(count: int, seed: int = 0) -> dict[str, list[Question]]:
    trivia = trivia_questions()
    random.Random(seed).shuffle(trivia)
    return {"trivia": trivia[:count], "cloze-en": cloze_en(count, seed), "cloze-zh": cloze_zh(count, seed)}


def distinct_n(samples: list[list[int]], n: int) -> float:
    """Distinct n-grams over all n-grams of the samples (1.0: no n-gram repeats)."""
    grams = [tuple(s[i:i + n]) for s in samples for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def bleu(candidate: list[int], references: list[list[int]], max_n: int = 4) -> float:
    """Sentence BLEU-4 with clipped counts, the brevity penalty against the closest reference length, and
    add-one smoothing of the n-gram precisions above unigrams (Lin and Och 2004)."""
    if not candidate or not references:
        return 0.0
    log_precision = 0.0
    for n in range(1, max_n + 1):
        grams = Counter(tuple(candidate[i:i + n]) for i in range(len(candidate) - n + 1))
        most = Counter()
        for reference in references:
            for gram, c in Counter(tuple(reference[i:i + n]) for i in range(len(reference) - n + 1)).items():
                most[gram] = max(most[gram], c)
        matched = sum(min(c, most[gram]) for gram, c in grams.items())
        total = sum(grams.values())
        if n == 1:
            if matched == 0:
                return 0.0
            log_precision += math.log(matched / total)
        else:
            log_precision += math.log((matched + 1) / (total + 1))
    closest = min((abs(len(r) - len(candidate)), len(r)) for r in references)[1]
    brevity = 1.0 if len(candidate) > closest else math.exp(1 - closest / len(candidate))
    return brevity * math.exp(log_precision / max_n)


def self_bleu(samples: list[list[int]]) -> float:
    """Mean BLEU-4 of each sample against the others (1.0: all the same)."""
    if len(samples) < 2:
        return 0.0
    return sum(bleu(s, samples[:i] + samples[i + 1:]) for i, s in enumerate(samples)) / len(samples)
