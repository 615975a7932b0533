"""Models named by hub id resolve from the local Hugging Face cache only (nothing is downloaded)."""

from __future__ import annotations

import shutil

import pytest

from llmaccel.errors import ModelNotFoundError
from llmaccel.llm import LLM
from llmaccel.model.loader import resolve_model_path
from llmaccel.sampling_params import SamplingParams


def cache_with(root, repo_id: str, model_dir) -> None:
    """The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_hub_id_in_the_local_cache_loads_and_generates(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    cache_with(tmp_path, "tiny-org/tiny-llama", llama_dir)
    assert resolve_model_path("tiny-org/tiny-llama").parent.parent.name == "models--tiny-org--tiny-llama"
    by_id = LLM("tiny-org/tiny-llama", num_kv_blocks=16)
    by_dir = LLM(str(llama_dir), num_kv_blocks=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert by_id.generate("Hello", params)[0].outputs[0].token_ids == \
        by_dir.generate("Hello", params)[0].outputs[0].token_ids


def test_a_hub_id_not_in_the_cache_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=rf"'Qwen/Qwen3-0.6B' is not in the local Hugging Face cache "
                                                 rf"\({tmp_path}.*huggingface-cli download Qwen/Qwen3-0.6B"):
        resolve_model_path("Qwen/Qwen3-0.6B")
    with pytest.raises(ModelNotFoundError, match="not found: give an HF directory"):
        resolve_model_path("no-such-dir/with/parts")
