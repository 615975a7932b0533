"""Training text for distillation, as token windows.

A corpus is a named one (`data/corpora.py`: enwiki, sanguo), a UTF-8 file, `chat`: the teacher's own
answers to the built-in chat prompts sampled at temperature 0.7, or `chat-greedy`: its greedy answers to
the same prompts, which is the text a draft model meets when the teacher decodes greedily (Medusa-2 and
EAGLE train their drafts on the target's own generations for the same reason), or `self-chat`: the
teacher's greedy answers to questions it wrote itself (Magpie, Xu et al. 2024: sampled from the chat
template up to where a user's message begins), as many as asked, none of them a benchmark's. The answers are
generated once by llmaccel's engine and kept in the run's directory, rendered through the chat template
as the served model will see them. Each corpus
is tokenized whole; its last `heldout_share` of tokens is held out for evaluation. Training windows
are drawn with a seeded generator (its state is saved with each checkpoint, so a resumed run draws what
an uninterrupted one would), corpus by corpus in turn across a batch's rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmaccel.data.corpora import NAMED_CORPORA, load_corpus

CHAT = "chat"
CHAT_GREEDY = "chat-greedy"
SELF_CHAT = "self-chat"
# the teacher's answers: corpus name -> sampling temperature
CHAT_TEMPERATURES = {CHAT: 0.7, CHAT_GREEDY: 0.0}
CORPUS_NAMES = (*NAMED_CORPORA, *CHAT_TEMPERATURES, SELF_CHAT)
_PLACEHOLDER = "QUERY_PLACEHOLDER_7f3a"


@dataclass(frozen=True)
class TokenCorpus:
    name: str
    train: torch.Tensor  # int64 [N]
    heldout: torch.Tensor  # int64 [M]


def chat_text(teacher_dir: Path, cache_file: Path, prompts: int, max_tokens: int, seed: int,
              temperature: float = 0.7) -> str:
    """The teacher's answers to the first `prompts` built-in chat prompts (sampled at `temperature`, one
    seed per prompt; greedy at 0), each conversation rendered through the chat template; generated once
    into cache_file."""
    if cache_file.is_file():
        return cache_file.read_bytes().decode("utf-8")  # bytes: no newline translation of a "\r" in it
    from llmaccel.data.prompts import builtin_prompts
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    chosen = builtin_prompts()[:prompts]
    llm = LLM(str(teacher_dir))
    conversations = [[{"role": "user", "content": p.prompt}] for p in chosen]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(len(chosen))]
    outputs = llm.chat(conversations, params, use_tqdm=True)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template(conversation + [{"role": "assistant", "content": out.outputs[0].text}],
                                           tokenize=False)
             for conversation, out in zip(conversations, outputs, strict=True)]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_bytes("\n".join(texts).encode("utf-8"))
    (cache_file.with_suffix(".jsonl")).write_text(
        "".join(json.dumps({"prompt": c[0]["content"], "answer": o.outputs[0].text}, ensure_ascii=False) + "\n"
                for c, o in zip(conversations, outputs, strict=True)), encoding="utf-8")
    return "\n".join(texts)


def self_chat_text(teacher_dir: Path, cache_file: Path, conversations: int, max_tokens: int, seed: int) -> str:
    """`conversations` questions sampled from the teacher at the start of a user turn (temperature 1, top-p
    0.95, one seed each; unfinished, too short and repeated ones dropped), each answered greedily, rendered
    through the chat template; generated once into cache_file."""
    if cache_file.is_file():
        return cache_file.read_bytes().decode("utf-8")  # bytes: no newline translation of a "\r" in it
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    llm = LLM(str(teacher_dir))
    tokenizer = llm.get_tokenizer()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], tokenize=False)
    before, after = rendered.split(_PLACEHOLDER)
    stop = [after.strip().split("\n")[0]] if after.strip() else []
    start = tokenizer(before, add_special_tokens=False)["input_ids"]
    asked = llm.generate([start] * conversations, [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=96,
                                                                  seed=seed + i, stop=stop)
                                                   for i in range(conversations)], use_tqdm=True)
    questions = list(dict.fromkeys(o.outputs[0].text.strip() for o in asked
                                   if o.outputs[0].finish_reason == "stop" and len(o.outputs[0].text.strip()) >= 10))
    chats = [[{"role": "user", "content": q}] for q in questions]
    answers = llm.chat(chats, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    texts = [tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": out.outputs[0].text}],
                                           tokenize=False) for chat, out in zip(chats, answers, strict=True)]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_bytes("\n".join(texts).encode("utf-8"))
    cache_file.with_suffix(".jsonl").write_text(
        "".join(json.dumps({"prompt": c[0]["content"], "answer": o.outputs[0].text}, ensure_ascii=False) + "\n"
                for c, o in zip(chats, answers, strict=True)), encoding="utf-8")
    return "\n".join(texts)


def check_corpus_names(names: list[str]) -> None:
    """Every name a named corpus, a chat corpus or an existing file; a ValueError naming the first that is not."""
    if not names:
        raise ValueError(f"give at least one --corpus: {', '.join(CORPUS_NAMES)} or a UTF-8 text file")
    for name in names:
        if name not in CORPUS_NAMES and not Path(name).expanduser().is_file():
            raise ValueError(f"--corpus {name!r} is neither a file nor one of {', '.join(CORPUS_NAMES)}")


def token_corpora(names: list[str], tokenizer, teacher_dir: Path, state_dir: Path, seq_len: int,
                  heldout_share: float = 0.05, chat_prompts: int = 200, chat_max_tokens: int = 320,
                  seed: int = 0, self_chat_conversations: int = 2000) -> list[TokenCorpus]:
    """Each corpus tokenized and split; a ValueError for one too short to give a window on both sides."""
    check_corpus_names(names)
    corpora = []
    for name in names:
        if name in CHAT_TEMPERATURES:
            text = chat_text(teacher_dir, state_dir / f"{name}-corpus.txt", chat_prompts, chat_max_tokens, seed,
                             CHAT_TEMPERATURES[name])
        elif name == SELF_CHAT:
            text = self_chat_text(teacher_dir, state_dir / f"{name}-corpus.txt", self_chat_conversations,
                                  chat_max_tokens, seed)
        else:
            text = load_corpus(name)
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        cut = int(len(ids) * (1 - heldout_share))
        if cut <= seq_len + 1 or len(ids) - cut <= seq_len + 1:
            raise ValueError(f"corpus {name!r} has {len(ids)} tokens: too few for windows of {seq_len + 1} "
                             f"tokens in both its training part and its held-out {heldout_share:.0%}")
        corpora.append(TokenCorpus(name, ids[:cut], ids[cut:]))
    return corpora


def training_batch(corpora: list[TokenCorpus], batch_size: int, seq_len: int,
                   generator: torch.Generator, by_size: bool = False) -> torch.Tensor:
    """[batch_size, seq_len + 1] windows at random offsets: row i from corpus i mod len(corpora), or with
    `by_size` from a corpus drawn in proportion to its training tokens."""
    rows = []
    sizes = torch.tensor([float(len(c.train)) for c in corpora])
    for i in range(batch_size):
        which = int(torch.multinomial(sizes, 1, generator=generator)) if by_size else i % len(corpora)
        ids = corpora[which].train
        start = int(torch.randint(0, len(ids) - seq_len - 1, (1,), generator=generator))
        rows.append(ids[start:start + seq_len + 1])
    return torch.stack(rows)


def heldout_windows(corpus: TokenCorpus, seq_len: int, count: int) -> torch.Tensor:
    """Up to `count` consecutive, non-overlapping [seq_len + 1] windows of the held-out tokens."""
    usable = min(count, (len(corpus.heldout) - 1) // seq_len)
    return torch.stack([corpus.heldout[i * seq_len:i * seq_len + seq_len + 1] for i in range(usable)])
