"""Prompt sets for the benchmarks: the built-in chat prompts, the Chinese test bed, ShareGPT files, random token prompts
(the prompt sources themselves live in data/prompts.py, below every package that reads them)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from llmaccel.data.prompts import builtin_prompts, read_sharegpt

DATASETS = ("builtin", "chinese", "sharegpt", "random")


@dataclass(frozen=True)
class SampleRequest:
    """One request of a serving benchmark: what to send and how many tokens to ask for."""

    prompt: str
    prompt_len: int  # tokens of the prompt text (the server's own count, with the chat template, may differ)
    expected_output_len: int


def builtin_requests(tokenizer, num_prompts: int, output_len: int | None = None) -> list[SampleRequest]:
    prompts = builtin_prompts()
    if num_prompts > len(prompts):
        raise ValueError(f"the built-in set has {len(prompts)} prompts; ask for at most that many")
    return [SampleRequest(p.prompt, len(tokenizer.encode(p.prompt, add_special_tokens=False)),
                          output_len or p.output_len) for p in prompts[:num_prompts]]


def chinese_requests(tokenizer, num_prompts: int, output_len: int | None = None, seed: int = 0,
                     max_prompt_len: int = 2048) -> list[SampleRequest]:
    """`num_prompts` of the Chinese test bed (data/chinese_prompts.py), in a seeded order; prompts over
    `max_prompt_len` tokens are passed over."""
    from llmaccel.data.chinese_prompts import chinese_prompts

    prompts = chinese_prompts()
    random.Random(seed).shuffle(prompts)
    chosen: list[SampleRequest] = []
    for start in range(0, len(prompts), 256):
        batch = prompts[start:start + 256]
        lengths = [len(ids) for ids in tokenizer([p.prompt for p in batch], add_special_tokens=False)["input_ids"]]
        for item, length in zip(batch, lengths, strict=True):
            if length <= max_prompt_len and len(chosen) < num_prompts:
                chosen.append(SampleRequest(item.prompt, length, output_len or item.output_len))
        if len(chosen) == num_prompts:
            return chosen
    raise ValueError(f"the Chinese test bed has {len(chosen)} prompts of at most {max_prompt_len} tokens; "
                     "ask for fewer")


def sharegpt_requests(path: Path, tokenizer, num_prompts: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """As vLLM samples ShareGPT: the first human turn is the prompt, the reply's token count the output
    length; pairs shorter than 4 tokens, prompts over 1024 or pairs over 2048 tokens are skipped."""
    conversations = [c.get("conversations") or c.get("conversation") or [] for c in read_sharegpt(path)]
    pairs = [(c[0]["value"], c[1]["value"]) for c in conversations
             if len(c) >= 2 and c[0].get("from") in ("human", "user") and isinstance(c[0].get("value"), str)
             and isinstance(c[1].get("value"), str)]
    random.Random(seed).shuffle(pairs)
    chosen: list[SampleRequest] = []
    for prompt, reply in pairs:
        if len(chosen) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        reply_len = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if prompt_len < 4 or reply_len < 4 or prompt_len > 1024 or prompt_len + reply_len > 2048:
            continue
        chosen.append(SampleRequest(prompt, prompt_len, reply_len))
    if len(chosen) < num_prompts:
        raise ValueError(f"{path} has only {len(chosen)} usable conversations; ask for fewer prompts")
    return chosen


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[SampleRequest]:
    """Prompts of random ordinary tokens; lengths drawn uniformly within +-range_ratio of the targets."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    vocab = [t for t in range(len(tokenizer)) if t not in special]

    def draw(target: int) -> int:
        return max(1, rng.randint(int(target * (1 - range_ratio)), int(target * (1 + range_ratio))))

    requests = []
    for _ in range(num_prompts):
        n = draw(input_len)
        text = tokenizer.decode([rng.choice(vocab) for _ in range(n)])
        requests.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), draw(output_len)))
    return requests


def corpus_tokens(tokenizer, count: int, skip: int = 0) -> list[int]:
    """Tokens skip .. skip + count of the built-in corpora (enwiki, then sanguo), repeated where they run short:
    long prompts of real text for the long-context benchmarks."""
    from llmaccel.data.corpora import load_corpus

    ids = tokenizer.encode(load_corpus("enwiki") + load_corpus("sanguo"), add_special_tokens=False)
    need = skip + count
    return (ids * (need // len(ids) + 1))[skip:need]
