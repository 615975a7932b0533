"""The command line as a user runs it: a real subprocess, real exit codes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from llmaccel.cli import build_parser
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmaccel.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_prints_the_same_text_as_the_api(llama_dir):
    result = _cli("generate", "--model", str(llama_dir), "--prompt", "The quick brown fox", "--max-tokens", "8",
                  "--ignore-eos", "-v")
    assert result.returncode == 0, result.stderr
    expected = LLM(str(llama_dir)).generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=8,
                                                                                  ignore_eos=True))
    assert result.stdout == expected[0].outputs[0].text + "\n"
    assert "8 generated" in result.stderr


def test_a_user_mistake_exits_2_with_the_reason():
    result = _cli("generate", "--model", "/no/such/model", "--prompt", "hi")
    assert result.returncode == 2
    assert "llmaccel: error: model '/no/such/model' not found" in result.stderr


def test_help_explains_every_flag():
    result = _cli("generate", "--help")
    assert result.returncode == 0
    for flag in ("--kv-cache-memory", "--max-num-batched-tokens", "--temperature", "--top-p", "--seed", "--chat"):
        assert flag in result.stdout


def test_every_command_formats_its_help():
    """A stray % in any help text breaks `--help` of the whole group it sits in (argparse %-formats them)."""
    def commands(parser: argparse.ArgumentParser, path: tuple[str, ...]):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from commands(sub, (*path, name))

    found = {path: parser.format_help() for path, parser in commands(build_parser(), ("llmaccel",))}
    assert ("llmaccel", "bench", "load-memory") in found and ("llmaccel", "serve") in found
    assert "weights + KV pool + 15%," in found[("llmaccel", "bench")]


def test_bench_offline_runs_all_three_systems(llama_dir, tmp_path):
    out = tmp_path / "offline.json"
    result = _cli("bench", "offline", "--model", str(llama_dir), "--num-prompts", "3", "--output-len", "4",
                  "--result-json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [r["system"] for r in data["results"]] == ["hf-sequential", "hf-static-batch", "llmaccel"]
    assert all(r["output_tokens"] == 12 for r in data["results"])
    assert data["results"][1]["generated_tokens"] == 12
    assert "vs HF static batch" in result.stdout
    llmaccel = data["results"][2]
    assert llmaccel["prefix_cache_queries"] == llmaccel["prompt_tokens"]  # the chat template's shared start hits
    assert 0 < llmaccel["prefix_cache_hits"] < llmaccel["prompt_tokens"]
    assert "llmaccel: prefix cache hits" in result.stdout
