"""What every finished answer passes before it leaves the server: the output guard (KL against a
reference, resampling) and the output filter (redact, or stop with finish_reason "content_filter").

A whole answer is guarded first, then filtered. A streamed answer is filtered as it streams (with a
short hold-back, see safety/output_filter.py) and guarded when it ends, before its final chunk.
"""

from __future__ import annotations

from dataclasses import replace

from llmaccel.outputs import CompletionOutput
from llmaccel.safety.input_filter import InputFilter
from llmaccel.safety.output_filter import OutputTextFilter
from llmaccel.safety.output_guard import GuardReport, OutputGuard, Regenerate
from llmaccel.sampling_params import SamplingParams

CONTENT_FILTER = "content_filter"


class AnswerChecks:
    def __init__(self, guard: OutputGuard | None, output_filter: InputFilter | None, metrics) -> None:
        self.guard = guard
        self.output_filter = output_filter
        self.metrics = metrics

    async def finish(self, prompt_ids: list[int], params: SamplingParams, output: CompletionOutput,
                     regenerate: Regenerate) -> tuple[CompletionOutput, GuardReport | None]:
        """The answer to serve in place of `output`, and the guard's report if it checked it."""
        report = None
        if self.guard is not None:
            report = await self.guard.review(prompt_ids, params, output, regenerate)
            if report is not None:
                output = report.output
        text_filter = self.stream_filter()
        if text_filter is not None:
            text = text_filter.whole(output.text)
            if text_filter.stopped_by is not None:
                output = replace(output, text=text, finish_reason=CONTENT_FILTER, stop_reason=text_filter.stopped_by)
            elif text != output.text:
                output = replace(output, text=text)
        return output, report

    async def review_stream(self, prompt_ids: list[int], params: SamplingParams,
                            output: CompletionOutput) -> GuardReport | None:
        """The guard's check of a streamed answer that just ended (never resampled: it was seen)."""
        if self.guard is None:
            return None
        return await self.guard.review(prompt_ids, params, output, None)

    def stream_filter(self) -> OutputTextFilter | None:
        """A fresh filter for one choice's text, or None without output rules."""
        if self.output_filter is None:
            return None
        return OutputTextFilter(self.output_filter, self.metrics)
