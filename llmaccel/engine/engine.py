"""LLMEngine: add_request / abort_request / step. One step = schedule, execute, update.

What it works out and loads at start is engine/loading.py; the checks a request passes before it is
queued, engine/request_checks.py; what a step's results do to their requests, engine/step_update.py.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass, replace

import torch

from llmaccel.config import EngineConfig
from llmaccel.engine.detokenizer import IncrementalDetokenizer
from llmaccel.engine.guard_stage import Judgement, Verdict, build_guard_stage
from llmaccel.engine.kv_cache_manager import KVCacheManager, PrefixCacheStats, cdiv
from llmaccel.engine.kv_tiers.offload import KVOffload, open_disk_tier
from llmaccel.engine.loading import check_reindexable, kv_layout, load_model, reindexes_sinks
from llmaccel.engine.priority_scheduling import build_scheduler
from llmaccel.engine.request import Request, RequestStatus
from llmaccel.engine.request_checks import check_prompt, check_request
from llmaccel.engine.request_group import RequestGroup, Sample
from llmaccel.engine.scoring import Divergence, SequenceScorer, divergence
from llmaccel.engine.step_update import advance_grammar, fail_group, take_token
from llmaccel.errors import InvalidRequestError
from llmaccel.lora.adapter import LoRAAdapter
from llmaccel.lora.manager import LoRAManager
from llmaccel.model.layers import weight_bytes
from llmaccel.model.loader import load_checkpoint, resolve_model_path
from llmaccel.model.step_interrupt import StepInterrupt, StepInterrupted
from llmaccel.ops.gemv import gemv_kernels
from llmaccel.ops.kv_int8 import kv_storage_dtype
from llmaccel.outputs import RequestMetrics, RequestOutput
from llmaccel.platform import describe, keep_freed_memory, peak_rss_bytes
from llmaccel.runner import ModelRunner
from llmaccel.sampling_params import SamplingParams
from llmaccel.spec.build import build_speculation
from llmaccel.spec.policy import SpeculationStats
from llmaccel.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What the last step ran: how many sequences and tokens shared the forward pass."""

    num_seqs: int
    num_tokens: int
    interrupted: bool = False  # stopped between layers for a request that outranks it: nothing of it was kept


class LLMEngine:
    def __init__(self, config: EngineConfig, use_kernel: bool | None = None) -> None:
        self.config = config
        began = time.perf_counter()
        torch.manual_seed(config.model.seed)
        self.device = torch.device(config.model.device)
        self.dtype = config.model.torch_dtype
        keep_freed_memory()  # before the load: the KV pool and the steps' tensors come from a heap kept
        checkpoint = load_checkpoint(config.model.model)
        if config.model.rope_scaling is not None:  # --rope-scaling replaces the config's
            checkpoint.spec = replace(checkpoint.spec, rope_scaling=dict(config.model.rope_scaling))
        self.spec = checkpoint.spec
        self.tokenizer = checkpoint.tokenizer
        self.hf_dir = checkpoint.hf_dir

        self.kv_dtype = kv_storage_dtype(config.cache.kv_cache_dtype, self.dtype, self.device)
        layout = kv_layout(config, self.spec, self.kv_dtype)
        num_blocks, block_size, bytes_per_token = layout.num_blocks, layout.block_size, layout.bytes_per_token
        window, sinks = layout.window, layout.sinks
        self.max_model_len = layout.max_model_len
        self.num_blocks = num_blocks
        self.bytes_per_block = bytes_per_token * block_size
        model, quantized_checkpoint = load_model(config, checkpoint, self.dtype, self.device, self.max_model_len,
                                                 use_kernel)
        del checkpoint
        # LoRA adapters beside the base model (lora/): every projection wrapped, the --lora-modules loaded
        self.loras = LoRAManager(model, config.lora, self.dtype, self.device) if config.lora.enabled else None
        # names the weights and numerics: prefix-cache hashes and result-cache keys start from it
        self.variant = "|".join(str(v) for v in (config.model.model, self.dtype, config.model.quantization,
                                                 config.model.quant_group_size, config.model.quantize_embedding))
        if config.model.rope_scaling is not None:
            self.variant += f"|rope={json.dumps(config.model.rope_scaling, sort_keys=True)}"
        if config.model.batch_invariant:  # other kernels: other roundings
            self.variant += "|batch-invariant"
        if self.kv_dtype != self.dtype:  # a quantized KV cache changes the numerics too
            self.variant += f"|kv={str(self.kv_dtype).removeprefix('torch.')}"
        reindexed = reindexes_sinks(config, window, sinks)
        if reindexed:  # a window's sinks at their places in the cache: other KV than the absolute form's
            check_reindexable(model)
            self.variant += "|sinks=cache"
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, self.variant,
                                       window, sinks, reindexed)
        self.scheduler = build_scheduler(config.scheduler, self.kv_cache)
        self.runner = ModelRunner(model, num_blocks, block_size, self.kv_dtype, self.device)
        self.runner.loras = self.loras
        self.runner.chunks_as_rows = config.model.batch_invariant
        self.kv_cache.turn_sink_keys = self.runner.turn_sink_keys
        self.grammars = GrammarCompiler(self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids)
        self.runner.grammars = self.grammars
        self.scorer = SequenceScorer(self.runner, self.kv_cache)
        speculation = build_speculation(config.speculative, model, self.tokenizer, num_blocks, block_size, self.dtype,
                                        self.device, self.max_model_len, window is not None, use_kernel)
        self.drafter, self.speculation = speculation if speculation is not None else (None, None)
        if self.speculation is not None:
            self.scheduler.draft_slots = self.speculation.draft_slots
        self._reference: SequenceScorer | None = None
        self._quantized_checkpoint = quantized_checkpoint
        self.runner.guard = self.guard = build_guard_stage(self, num_blocks)  # the semantic input guard, or None
        if self.guard is None:  # the guard keeps a row sum per whole block, so it reuses whole blocks only
            self.kv_cache.copy_prefix = self._copy_kv_prefix
        if config.cache.kv_offload_dir is not None:
            self.kv_cache.attach_tier(self._open_disk_tier(config))
        machine = describe()
        logger.info("machine: %s, %s cores, features %s%s; dtype %s%s; weight-streaming kernels: %s",
                    machine["cpu"], machine["cores"], ",".join(machine["features"]) or "none",
                    f", GPU {machine['gpu']}" if machine["gpu"] else "", str(self.dtype).removeprefix("torch."),
                    " (auto)" if config.model.dtype == "auto" else "",
                    "on" if self.device.type == "cpu" and gemv_kernels() is not None else "off")
        logger.info("KV cache: %d blocks x %d tokens = %d tokens of capacity (%.2f GiB, %s); max_model_len %d; "
                    "attention: %s", num_blocks, block_size, num_blocks * block_size,
                    num_blocks * block_size * bytes_per_token / 2**30, str(self.kv_dtype).removeprefix("torch."),
                    self.max_model_len,
                    "C++ paged kernel" if model.attention.uses_kernel else "torch reference")
        logger.info("weights: %.0f MB; loaded in %.1f s, peak RSS so far %.2f GB", self.weight_bytes / 1e6,
                    time.perf_counter() - began, peak_rss_bytes() / 1e9)
        self._groups: dict[str, RequestGroup] = {}
        self._sample_to_group: dict[str, RequestGroup] = {}
        self._counter = 0
        self.num_steps = 0
        self.num_failed_steps = 0
        # another thread raises it to stop the step in flight for a request that outranks it (see
        # model/step_interrupt.py; only --scheduling-policy priority raises it)
        self.interrupt = StepInterrupt()
        self.num_interrupted_steps = 0
        self.last_step = StepStats(0, 0)
        self.last_step_failed = False  # the last step's forward pass raised (its requests were failed)
        self.record_confidence = False  # the output guard wants each sample's mean top probability

    def _open_disk_tier(self, config: EngineConfig) -> KVOffload:
        """The disk tier (--kv-offload-dir) over the target's KV pool and a draft model's."""
        if self.guard is not None:
            raise ValueError("--kv-offload-dir cannot run with the semantic guard, which keeps a sum per cached block "
                             "that the disk tier does not hold; turn one of them off")
        slabs = [self.runner.kv_slab]
        paths = [str(resolve_model_path(config.model.model))]
        if self.drafter is not None and self.drafter.kv_slab is not None:
            slabs.append(self.drafter.kv_slab)
            paths.append(str(resolve_model_path(config.speculative.speculative_model)))
        tier = open_disk_tier(config.cache.kv_offload_dir, config.cache.kv_offload_size, self.variant, paths, slabs,
                              config.cache.block_size, config.cache.kv_offload_policy == "write-through")
        stats = tier.store.stats
        logger.info("KV disk tier: %s, %d blocks (%.2f GiB) there from before, up to %.2f GiB", tier.store.folder,
                    stats.files, stats.disk_bytes / 2**30, tier.store.capacity / 2**30)
        return tier

    def close(self) -> None:
        """Write the prefix cache's blocks to the disk tier, if there is one, and stop its threads (at shutdown)."""
        tier = self.kv_cache.tier
        if tier is not None:
            began, stored = time.perf_counter(), tier.store.stats.stored_bytes
            self.kv_cache.spill_all()
            tier.close()
            logger.info("KV disk tier: wrote %.1f MB of blocks at shutdown in %.2f s; %d blocks (%.2f GiB) in %s",
                        (tier.store.stats.stored_bytes - stored) / 1e6, time.perf_counter() - began,
                        tier.store.stats.files, tier.store.stats.disk_bytes / 2**30, tier.store.folder)

    def _copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """A partial prefix-cache hit: the first `num_tokens` KV slots of block `source` into `target`, in the
        target's pool and the draft's (whose KV for cached blocks it reuses as well)."""
        self.runner.copy_kv_prefix(source, target, num_tokens)
        if self.drafter is not None:
            self.drafter.copy_kv_prefix(source, target, num_tokens)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, owner: str = "") -> str:
        """Validate and queue a request. Raises InvalidRequestError (a ValueError) naming the problem;
        nothing is queued then, and every other request carries on. `priority` (lower first) and `owner` (who sent
        it) count with --scheduling-policy priority (engine/priority_scheduling.py)."""
        if request_id is None:
            request_id = f"req-{self._counter}"
            self._counter += 1
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.check_request(token_ids, params)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival = arrival_time if arrival_time is not None else time.time()
        samples = []
        for i in range(params.n):
            sample_params = params
            if params.n > 1 and params.seed is not None:  # different but reproducible samples
                sample_params = replace(params, seed=params.seed + i, n=1)
            sample_id = request_id if params.n == 1 else f"{request_id}#{i}"
            request = Request(sample_id, token_ids, sample_params, self.spec.eos_token_ids, max_tokens, arrival,
                              priority, owner)
            if params.structured_outputs is not None:
                request.grammar = self.grammars.matcher(params.structured_outputs)
            if params.lora is not None:
                request.lora_slot = self.loras.slot(params.lora)
                request.cache_salt = f"lora={self.loras.adapters[params.lora].digest}"
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens)
            samples.append(Sample(request, detok, [] if params.logprobs is not None else None))
        group = RequestGroup(request_id, text, token_ids, samples, RequestMetrics(arrival_time=arrival))
        self._groups[request_id] = group
        for sample in samples:
            self._sample_to_group[sample.request.request_id] = group
            self.scheduler.add_request(sample.request)
        return request_id

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raise InvalidRequestError unless the prompt is non-empty, in the vocabulary and fits the window."""
        check_prompt(token_ids, self.max_model_len, self.spec.vocab_size)

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """check_prompt, and the sampling parameters that depend on the model (token ids, the LoRA adapter)."""
        check_request(token_ids, params, self.max_model_len, self.spec.vocab_size, self.grammars)
        if params.lora is not None and (self.loras is None or params.lora not in self.loras.adapters):
            loaded = sorted(self.loras.adapters) if self.loras is not None else []
            raise InvalidRequestError(
                f"no LoRA adapter named {params.lora!r} is loaded" + (f" (loaded: {', '.join(loaded)})" if loaded
                else " (start the server with --lora-modules NAME=DIR, or --enable-lora and load one)"),
                param="model")

    # ---- LoRA adapters (call between steps) ------------------------------------------------------
    def add_lora(self, name: str, path: str) -> LoRAAdapter:
        """Load a PEFT adapter directory as `name`; AdapterError (a ValueError naming the problem) if it cannot be."""
        return self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name`; refused while a request uses it."""
        manager = self._lora_manager()
        users = sum(1 for group in self._groups.values() for sample in group.samples
                    if sample.request.params.lora == name)
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {users} request(s); unload it after they "
                                      "finish")
        manager.remove(name)

    def _lora_manager(self) -> LoRAManager:
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters are off: start with --enable-lora (or --lora-modules)")
        return self.loras

    @property
    def lora_adapters(self) -> dict[str, LoRAAdapter]:
        return dict(self.loras.adapters) if self.loras is not None else {}

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token | the tokens before it) for every token after the first, as perplexity needs.

        Prefill outside the scheduler, on blocks lent from the pool: call it between steps. The text
        goes through in one chunk, or with a KV window in window-long chunks, each seeing only the
        sinks and the window, as a long conversation would. `last_score_blocks` says how many blocks
        it held at most."""
        self.check_prompt(token_ids)
        return self.scorer.logprobs(token_ids)

    @property
    def last_score_blocks(self) -> int:
        """The most KV blocks the last `score` held."""
        return self.scorer.last_blocks

    def divergence(self, prompt_ids: list[int], output_ids: list[int], params: SamplingParams) -> Divergence:
        """How far a finished continuation's sampling distributions were from the reference (see
        engine/scoring.py): the output guard's measure. Call between steps."""
        return divergence(self.scorer, self.reference_scorer(), prompt_ids, output_ids, params,
                          self.spec.eos_token_ids)

    def reference_scorer(self) -> SequenceScorer | None:
        """The scorer of a full-precision copy of the model (see float_copy), built at the first call
        and kept; None when there is none to build."""
        if self._reference is None:
            float_engine = self.float_copy(cdiv(self.max_model_len, self.config.cache.block_size) + 1)
            self._reference = float_engine.scorer if float_engine is not None else None
        return self._reference

    def float_copy(self, num_kv_blocks: int) -> LLMEngine | None:
        """A second engine on the same checkpoint without quantization, with `num_kv_blocks` of KV, when
        this one quantizes at load; None otherwise (a float model is its own reference, and a checkpoint
        saved quantized has no float weights to load)."""
        model = self.config.model
        if (model.quantization is None and not model.quantize_embedding) or self._quantized_checkpoint:
            return None
        return LLMEngine(EngineConfig.create(model.model, device=model.device, dtype=model.dtype,
                                             block_size=self.config.cache.block_size, num_kv_blocks=num_kv_blocks,
                                             max_model_len=self.max_model_len))

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. False if it is unknown or already done."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for sample in group.samples:
            self.scheduler.finish_request(sample.request, RequestStatus.FINISHED_ABORTED)
            self._forget(sample)
        return True

    def abort_all(self) -> int:
        """Abort every request (at shutdown); returns how many there were."""
        ids = list(self._groups)
        for request_id in ids:
            self.abort_request(request_id)
        return len(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """Schedule, run the model, update. Returns an output for each request that changed
        (only for those that finished when `emit_unfinished` is False, as the offline API needs).

        Faults are contained: a request whose sampling, stop check or detokenization raises ends
        alone with finish reason "error" and the rest of the step goes on; a forward pass that
        raises fails the requests of this step (no one request can be blamed) and
        `last_step_failed` says so. Either way their blocks are freed and the engine carries on."""
        scheduled = self.scheduler.schedule()
        self.last_step = StepStats(len(scheduled.scheduled), scheduled.num_tokens)
        self.last_step_failed = False
        if scheduled.is_empty:
            if self.kv_cache.tier is not None:  # only requests whose prefix is being read: wait for one
                self.kv_cache.tier.wait_for_loads(0.05)
            return []
        self.num_steps += 1
        now = time.time()
        groups = {}  # the user requests of this step
        for item in scheduled.scheduled:
            group = self._sample_to_group[item.request.request_id]
            groups[group.request_id] = group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
        drafting = [item for item in scheduled.scheduled if item.num_draft_slots]
        for request in scheduled.preempted:
            if self.drafter is not None:
                self.drafter.forget(request.request_id)
        began = time.perf_counter()
        try:
            drafts = self.drafter.propose(drafting) if drafting else {}
            features = self.drafter is not None and self.drafter.wants_features
            # a drafter has moved on by the time a step could stop: steps with speculation always complete
            interrupt = self.interrupt if self.drafter is None else None
            results = self.runner.execute(scheduled, self.record_confidence, drafts, features, interrupt)
            if features:
                self.drafter.observe(results.features)
            if results.prompt_logprobs:  # a prefill's prompt logprobs, for the requests that asked
                by_id = {item.request.request_id: item.request for item in scheduled.scheduled}
                for request_id, (first, items) in results.prompt_logprobs.items():
                    by_id[request_id].prompt_logprobs[first:first + len(items)] = items
        except StepInterrupted:  # for a request that outranks this step's rows: nothing of it is kept
            self.num_interrupted_steps += 1
            self.last_step = replace(self.last_step, interrupted=True)
            logger.debug("engine step %d stopped between layers for a request of higher rank", self.num_steps)
            return []
        except Exception as exc:
            self.last_step_failed = True
            self.num_failed_steps += 1
            logger.error("engine step %d failed; ending its %d request(s) (%s) with an error", self.num_steps,
                         len(scheduled.scheduled), ", ".join(i.request.request_id for i in scheduled.scheduled),
                         exc_info=exc)
            for group in groups.values():
                fail_group(self.scheduler, group, exc)
            return [self._finish_group(group, time.time()) for group in groups.values()]
        if self.kv_cache.tier is not None and scheduled.num_tokens >= 4 * len(scheduled.scheduled):
            # mostly prompt tokens: what computing a block costs, against which the disk tier's loads are weighed
            self.kv_cache.tier.observe_step(scheduled.num_tokens, time.perf_counter() - began)
        failed = dict(results.failed)
        before = {item.request.request_id: item.request.num_output_tokens for item in scheduled.scheduled}
        advanced = self.scheduler.update(scheduled, {rid: [tok for tok, _, _ in taken]
                                                     for rid, taken in results.sampled.items()}, failed)
        now = time.time()
        changed: dict[str, RequestGroup] = {}
        num_new_tokens = 0
        for request in advanced:
            group = self._sample_to_group[request.request_id]
            rid = request.request_id
            taken = results.sampled[rid][:request.num_output_tokens - before[rid]]
            num_new_tokens += len(taken)
            if rid in drafts:
                accepted = len(results.sampled[rid]) - 1
                self.speculation.stats.record(len(drafts[rid]), accepted)
                group.metrics.spec_draft_tokens += len(drafts[rid])
                group.metrics.spec_accepted_tokens += accepted
            try:
                for i, sampled in enumerate(taken):
                    if take_token(self.scheduler, group, request, sampled, before[rid] + i, now):
                        request.truncate_output(before[rid] + i + 1)  # a stop string ended it: drop the rest
                        break
                if request.grammar is not None:
                    advance_grammar(self.scheduler, request, before[rid])
            except Exception as exc:
                failed[request.request_id] = exc
            changed[group.request_id] = group
        if self.speculation is not None and all(item.num_new_tokens == 1 for item in scheduled.scheduled):
            caught_up = bool(drafting) and not self.drafter.steady
            self.speculation.record_step(len(scheduled.scheduled), bool(drafting), num_new_tokens,
                                         time.perf_counter() - began, caught_up=caught_up)
        for request_id, judgement in results.judged.items():
            self._judged(request_id, judgement, changed, now)
        for request_id, vector in results.embeddings.items():  # an embedding request ends with its prompt
            group = self._sample_to_group[request_id]
            request = group.samples[0].request
            if not request.is_finished:
                request.embedding = vector
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
                changed[group.request_id] = group
        for request_id, exc in failed.items():
            group = self._sample_to_group[request_id]
            if group.error is not None:  # a sibling's failure ended its group already
                continue
            logger.error("request %s failed in engine step %d; ending it with an error", request_id, self.num_steps,
                         exc_info=exc)
            fail_group(self.scheduler, group, exc)
            changed[group.request_id] = group
        outputs = []
        for group in changed.values():
            if group.finished:
                outputs.append(self._finish_group(group, now))
            elif emit_unfinished:
                outputs.append(group.output(self.record_confidence))
        return outputs

    def _judged(self, request_id: str, judgement: Judgement, changed: dict[str, RequestGroup], now: float) -> None:
        """A prompt the semantic guard judged: a blocked one ends (every sample, no token), a flagged one is logged."""
        group = self._sample_to_group[request_id]
        if group.metrics.guard_verdict_time is None:
            group.metrics.guard_verdict_time = now
        if judgement.verdict is Verdict.PASS:
            return
        if judgement.verdict is Verdict.FLAG:
            if self.config.guard.semantic_guard_action == "flag":
                logger.warning("semantic guard flagged request %s (score %.3f >= %.3f); serving it", group.request_id,
                               judgement.score, judgement.threshold)
            return
        if group.blocked is None:
            logger.warning("semantic guard blocked request %s (score %.3f >= %.3f)", group.request_id,
                           judgement.score, judgement.threshold)
            group.blocked = judgement.describe()
        for sample in group.samples:
            self.scheduler.finish_request(sample.request, RequestStatus.FINISHED_FILTERED)
        changed[group.request_id] = group

    def _finish_group(self, group: RequestGroup, now: float) -> RequestOutput:
        group.metrics.finished_time = now
        for sample in group.samples:
            self._forget(sample)
        del self._groups[group.request_id]
        return group.output(self.record_confidence)

    def _forget(self, sample: Sample) -> None:
        self._sample_to_group.pop(sample.request.request_id, None)
        self.runner.release(sample.request.request_id)
        if self.drafter is not None:
            self.drafter.forget(sample.request.request_id)

    # ---- introspection ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache and found there, since the engine started."""
        return self.kv_cache.stats

    @property
    def kv_tier_stats(self) -> dict[str, dict] | None:
        """The KV tiers below RAM by name ("disk"), each one's counts since the engine started; None without."""
        tier = self.kv_cache.tier
        return None if tier is None else {"disk": tier.stats()}

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0..1."""
        return self.kv_cache.usage

    @property
    def memory_bytes(self) -> dict[str, int]:
        """What the engine holds: weights, the KV pool reserved, and the part of it ever written (the
        pool is mapped lazily, so only that part is resident)."""
        per_block = self.bytes_per_block
        return {"weights": self.weight_bytes, "kv_pool": self.num_blocks * per_block,
                "kv_pool_touched": self.kv_cache.pool.num_touched * per_block}

    @functools.cached_property
    def weight_bytes(self) -> int:
        return weight_bytes(self.runner.model)  # the weights never change: walk the model once

    @property
    def num_running_seqs(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting_seqs(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """Drafts proposed and kept since the engine started; None without speculative decoding."""
        return self.speculation.stats if self.speculation is not None else None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
