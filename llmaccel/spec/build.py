"""Build the drafter and policy a config asks for, refusing settings that cannot work, at start."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llmaccel.config import SpeculativeConfig
from llmaccel.model.causal_lm import CausalLM
from llmaccel.model.layers import weight_bytes
from llmaccel.model.loader import load_checkpoint
from llmaccel.model.projection_kernels import unify_bf16_kernels
from llmaccel.model.registry import model_class
from llmaccel.model.spec import ModelSpec
from llmaccel.runner import ModelRunner
from llmaccel.spec.draft_head import DraftHead, HeadDrafter
from llmaccel.spec.draft_vocab import DraftVocabulary, check_draft_vocab_size, cut_head, frequent_tokens
from llmaccel.spec.drafters import Drafter, LookupFirstDrafter, ModelDrafter, NgramDrafter
from llmaccel.spec.head_dir import is_draft_head
from llmaccel.spec.policy import SpeculationPolicy

logger = logging.getLogger(__name__)


def build_speculation(config: SpeculativeConfig, target: CausalLM, tokenizer, num_blocks: int,
                      block_size: int, dtype: torch.dtype, device: torch.device, max_model_len: int,
                      windowed: bool, use_kernel: bool | None = None) -> tuple[Drafter, SpeculationPolicy] | None:
    """The drafter and the policy, or None when speculation is off. Raises ValueError naming the problem:
    a draft model whose tokenizer or vocabulary differs from the target's, or a windowed KV cache."""
    method = config.method
    if method is None:
        return None
    if windowed:
        raise ValueError("speculative decoding does not run with a KV window or a sliding-window model yet; "
                         "drop --kv-window or the speculative options")
    policy = SpeculationPolicy(config.num_speculative_tokens, max_model_len, config.speculative_max_batch)
    unify_bf16_kernels(target, config.num_speculative_tokens + 1)
    if method == "ngram":
        logger.info("speculative decoding: ngram prompt lookup (n %d..%d), up to %d drafts a step",
                    config.prompt_lookup_min, config.prompt_lookup_max, config.num_speculative_tokens)
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max), policy
    if is_draft_head(config.speculative_model):
        drafter = build_head_drafter(config, target, tokenizer, num_blocks, block_size, dtype, device)
    else:
        drafter = build_model_drafter(config, target, tokenizer, num_blocks, block_size, dtype, device, max_model_len,
                                      use_kernel)
    if config.speculative_lookup:
        logger.info("speculative decoding: prompt lookup (n %d..%d) first, the draft where the context does not "
                    "repeat", config.prompt_lookup_min, config.prompt_lookup_max)
        return LookupFirstDrafter(drafter, NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)), policy
    return drafter, policy


def build_model_drafter(config: SpeculativeConfig, target: CausalLM, tokenizer, num_blocks: int,
                        block_size: int, dtype: torch.dtype, device: torch.device, max_model_len: int,
                        use_kernel: bool | None) -> ModelDrafter:
    """A smaller model with the target's tokenizer, its LM head cut if asked."""
    checkpoint = load_checkpoint(config.speculative_model)
    check_same_tokenizer(config.speculative_model, checkpoint.spec, checkpoint.tokenizer, target.spec, tokenizer)
    draft = model_class(checkpoint.spec.architecture)(checkpoint.spec, checkpoint.weights, dtype, device,
                                                      max_positions=max_model_len, use_kernel=use_kernel)
    del checkpoint
    vocabulary, size = None, config.speculative_draft_vocab
    if size is not None:
        check_draft_vocab_size(size, draft.spec.vocab_size)
    if size is not None and size < draft.spec.vocab_size:  # the whole vocabulary: the head as it is
        ids = frequent_tokens(hf_dir_or_none(config.speculative_model), tokenizer, size, draft.spec.vocab_size)
        vocabulary = DraftVocabulary(ids, cut_head(draft.lm_head, ids))
    draft_bytes, target_bytes = weight_bytes(draft), weight_bytes(target)
    if draft_bytes >= target_bytes:
        logger.warning("the draft model's weights (%.0f MB) are not smaller than the model's (%.0f MB): "
                       "drafting will cost more than it saves", draft_bytes / 1e6, target_bytes / 1e6)
    head = ("its LM head" if vocabulary is None else
            f"its LM head cut to {len(vocabulary.token_ids)} tokens, {vocabulary.weight_bytes / 1e6:.0f} MB")
    logger.info("speculative decoding: draft model %s (%d layers, %.0f MB; %s), up to %d drafts a step",
                config.speculative_model, draft.spec.num_layers, draft_bytes / 1e6, head,
                config.num_speculative_tokens)
    return ModelDrafter(ModelRunner(draft, num_blocks, block_size, dtype, device), vocabulary)


def build_head_drafter(config: SpeculativeConfig, target: CausalLM, tokenizer, num_blocks: int,
                       block_size: int, dtype: torch.dtype, device: torch.device) -> HeadDrafter:
    """A draft head (`llmaccel distill-head`) drafting over the vocabulary it was trained on, unless
    --speculative-draft-vocab says otherwise."""
    from transformers import AutoTokenizer

    directory = Path(config.speculative_model).expanduser()
    if type(target).__name__ != "LlamaForCausalLM":
        raise ValueError(f"a draft head ({directory}) drafts for Llama-family models (Llama, Mistral, Qwen2, SmolLM2); "
                         f"this model is {target.spec.architecture}: use a draft model or --speculative-method ngram")
    head = DraftHead(directory, target, dtype, device)
    if head.section.get("kind") != "eagle":
        raise ValueError(f"{directory}: draft head kind {head.section.get('kind')!r} is not one llmaccel runs (eagle)")
    head_tokenizer = AutoTokenizer.from_pretrained(directory)
    check_same_tokenizer(str(directory), target.spec, head_tokenizer, target.spec, tokenizer, role="draft head")
    size = config.speculative_draft_vocab or head.section.get("draft_vocab") or target.spec.vocab_size
    check_draft_vocab_size(size, target.spec.vocab_size)
    vocabulary = None
    if size < target.spec.vocab_size:
        ids = frequent_tokens(directory, tokenizer, size, target.spec.vocab_size)
        vocabulary = DraftVocabulary(ids, cut_head(target.lm_head, ids))
    head_bytes = weight_bytes(head.fc) + weight_bytes(head.layers) + weight_bytes(head.norm)
    logger.info("speculative decoding: draft head %s (one layer, %.1f MB; drafting over %s), up to %d drafts a step",
                directory, head_bytes / 1e6, "the whole vocabulary" if vocabulary is None else f"{size} tokens",
                config.num_speculative_tokens)
    return HeadDrafter(ModelRunner(head, num_blocks, block_size, dtype, device), vocabulary)


def hf_dir_or_none(name: str) -> Path | None:
    """The draft's directory, where its token counts may lie (None for a GGUF file)."""
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def check_same_tokenizer(name: str, spec: ModelSpec, tokenizer, target_spec: ModelSpec, target_tokenizer,
                         role: str = "draft model") -> None:
    """A draft proposes token ids (a cascade model gets them): they must mean the same text to both models."""
    if spec.vocab_size != target_spec.vocab_size:
        raise ValueError(f"the {role} {name} has a vocabulary of {spec.vocab_size} tokens, the model "
                         f"{target_spec.vocab_size}: a {role} must share the model's tokenizer")
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"the {role} {name}'s tokenizer maps tokens to other ids than the model's: a {role} "
                         "must share the model's tokenizer")
