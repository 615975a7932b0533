"""llmaccel: an LLM inference accelerator (paged KV cache, continuous batching)."""

import os

from llmaccel.logging_setup import configure_logging

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever fetched from a model hub at run time
configure_logging()

from llmaccel.llm import LLM  # noqa: E402
from llmaccel.outputs import CompletionOutput, RequestOutput  # noqa: E402
from llmaccel.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
