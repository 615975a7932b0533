from __future__ import annotations

import os

import pytest

from llmaccel.platform import AUTO_DTYPE_ENV

# The suite's exact comparisons are against HF float32: pin what --dtype auto means (servers the tests
# start inherit it), so a machine with bf16 hardware runs the same checks. tests/test_platform.py tests
# the choice itself on every kind of machine.
os.environ.setdefault(AUTO_DTYPE_ENV, "float32")

from tests.tiny_models import TINY_CONFIGS, build_tokenizer, make_tiny_model


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_tiny_model(name, root, tiny_tokenizer) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-gqa"]


def pytest_terminal_summary(terminalreporter) -> None:
    from tests.summary import LINES

    if LINES:
        terminalreporter.section("llmaccel figures")
        for line in LINES:
            terminalreporter.write_line(line)
