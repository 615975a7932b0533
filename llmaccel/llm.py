"""LLM: the offline batch API.

    llm = LLM()  # the default model, smollm2-135m
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tqdm.auto import tqdm

from llmaccel.config import DEFAULT_MODEL, EngineConfig
from llmaccel.engine.engine import LLMEngine
from llmaccel.outputs import RequestOutput
from llmaccel.sampling_params import SamplingParams

Prompt = str | list[int] | dict  # dict: {"prompt": str} or {"prompt_token_ids": [...]}, as in vLLM
Conversation = list[dict[str, str]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, use_kernel: bool | None = None, **engine_options: object) -> None:
        self.config = EngineConfig.create(model, **engine_options)
        self.engine = LLMEngine(self.config, use_kernel=use_kernel)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        A prompt is a string or a list of token ids. Invalid prompts raise before anything runs.
        `use_tqdm=None` shows a progress bar for batches of more than 8 prompts on a terminal.
        """
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                ids.append(self.engine.add_request(None, _unwrap(prompt), params))
        except ValueError:
            for request_id in ids:  # all or nothing: leave the engine as it was
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, conversations: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def close(self) -> None:
        """Write the prefix cache to the disk tier, where there is one (`kv_offload_dir`), so a later LLM on the same
        directory finds it; the LLM is not used afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.tokenizer

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        if use_tqdm is None:
            use_tqdm = len(ids) > 8 and sys.stderr.isatty()
        pending = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        while pending:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with {len(pending)} request(s) unfinished")
            for output in self.engine.step(emit_unfinished=False):
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]


def _unwrap(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
    return prompt
