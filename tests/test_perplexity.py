"""Perplexity: the engine's scores equal HF transformers' log-probabilities, the sliding window
scores every token once, corpora are read or refused clearly."""

from __future__ import annotations

import math

import pytest
import torch

from llmaccel.cli import main
from llmaccel.config import EngineConfig
from llmaccel.data.corpora import load_corpus, strip_wiki_markup
from llmaccel.engine.engine import LLMEngine
from llmaccel.quantization.perplexity import perplexity

TEXT = ("The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks. "
        "Continuous batching packs every active request into each forward pass of the model. 你好，世界！") * 3


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig.create(str(llama_dir), num_kv_blocks=64))


def hf_window_logprobs(llama_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_engine_scores_equal_hf_logprobs_and_free_their_blocks(engine, llama_dir):
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)[:90]
    got = torch.tensor(engine.score(ids))
    assert got.shape == (89,)
    assert torch.allclose(got, hf_window_logprobs(llama_dir, ids), atol=1e-4)
    assert engine.num_free_blocks == engine.num_blocks


def test_sliding_window_scores_each_token_once_with_the_context_it_had(engine, llama_dir):
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)[:100]
    result = perplexity(engine, TEXT, max_tokens=100, ctx=40, stride=25, progress=False)
    assert result.num_tokens == 99  # every token but the first, once
    total, scored_until = 0.0, 1
    for begin in range(0, 99, 25):  # the reference: HF over the same windows
        end = min(begin + 40, 100)
        logprobs = hf_window_logprobs(llama_dir, ids[begin:end])
        total -= logprobs[scored_until - begin - 1:].sum().item()
        scored_until = end
        if end == 100:
            break
    assert result.perplexity == pytest.approx(math.exp(total / 99), rel=1e-4)


def test_window_arguments_are_checked(engine):
    with pytest.raises(ValueError, match="--stride must be in"):
        perplexity(engine, TEXT, 100, ctx=32, stride=64, progress=False)
    with pytest.raises(ValueError, match="must be below the model's max_model_len"):
        perplexity(engine, TEXT, 100, ctx=5000, stride=64, progress=False)


def test_corpus_files_are_read_or_refused_clearly(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("你好 hello", encoding="utf-8")
    assert load_corpus(str(good)) == "你好 hello"
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(ValueError, match="is not UTF-8"):
        load_corpus(str(tmp_path / "latin1.txt"))
    with pytest.raises(ValueError, match="neither a file nor one of enwiki, sanguo"):
        load_corpus(str(tmp_path / "missing.txt"))


def test_wiki_markup_is_stripped():
    body = ("'''Anarchism''' is a [[political philosophy]] that advocates [[self-governance|self-governed]] "
            "societies.{{cite book|title=X}}<ref>Some source</ref> It is old.\n== History ==\n* Early ideas "
            "[[Category:Politics]]" + " More text." * 20)
    xml = f"<page><text xml:space=\"preserve\">{body}</text></page>"
    text = strip_wiki_markup(xml)
    assert text.startswith("Anarchism is a political philosophy that advocates self-governed societies. It is old.")
    assert "History\nEarly ideas" in text and "{{" not in text and "<ref>" not in text and "Category" not in text


def test_eval_ppl_cli_prints_a_table(llama_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    assert main(["eval", "ppl", "--model", str(llama_dir), "--corpus", str(corpus), "--max-tokens", "120",
                 "--ctx", "48", "--stride", "24", "--quantization", "int4", "--quant-group-size", "32",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "| variant | ppl corpus.txt | vs int4 corpus.txt | weight MiB |" in out
    assert "| int4 | " in out


def test_eval_ppl_compare_runs_the_chosen_variants_against_fp32(llama_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    args = ["eval", "ppl", "--model", str(llama_dir), "--corpus", str(corpus), "--max-tokens", "120", "--ctx", "48",
            "--stride", "24", "--no-progress", "--compare", "--no-speed"]
    assert main(args + ["--variants", "int8+emb8,int4-g32+emb8"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    names = [line.split(" | ")[0] for line in lines]
    assert names[0] == "| variant" and names[2:] == ["| int8+emb8", "| int4-g32+emb8"]
    assert names[1] in ("| unquantized (float32)", "| unquantized (bfloat16)")  # the reference, in the auto dtype
    fp32, int8, int4 = (int(line.split(" | ")[-1].rstrip(" |%")) for line in lines[1:])  # weight change vs fp32
    assert int4 < int8 < fp32 == 0
    assert main(args + ["--variants", "int3"]) == 2
    assert "unknown variant(s) int3; choose from fp32, int8, int8+awq, int8+emb8" in capsys.readouterr().err
