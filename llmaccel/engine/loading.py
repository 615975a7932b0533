"""What LLMEngine works out and loads at start: the KV pool's size and the context window it allows,
and the model with its weights as the checkpoint and --quantization ask.

A KV window (--kv-window, or a model whose every layer slides) bounds the blocks a sequence holds, so then
only the model's positions limit its length. The weights are a checkpoint saved quantized, taken as it is;
a GGUF file's own quantized tensors (--quantization gguf); or float weights, quantized at load if asked.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from llmaccel.config import EngineConfig
from llmaccel.engine.kv_cache_manager import cdiv
from llmaccel.model.causal_lm import CausalLM
from llmaccel.model.loader import LoadedCheckpoint, resolve_model_path
from llmaccel.model.registry import model_class
from llmaccel.model.rope import scaling_kind, servable_positions
from llmaccel.model.spec import ModelSpec
from llmaccel.ops.kv_int8 import bytes_per_element_row
from llmaccel.platform import available_memory_bytes
from llmaccel.quantization.prequantized import load_prequantized

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVLayout:
    """The KV pool and the context it allows. `window`, `sinks`: the KV window's (window None: none)."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    window: int | None
    sinks: int
    max_model_len: int


def reindexes_sinks(config: EngineConfig, window: int | None, sinks: int) -> bool:
    """Whether a KV window's sinks move to their places in the cache (--kv-positions cache,
    engine/kv_cache_manager.py); with no sinks the two forms are the same."""
    return window is not None and sinks > 0 and config.cache.kv_positions == "cache"


def check_reindexable(model: CausalLM) -> None:
    """ValueError unless every key can be turned to a new position by a rotation (--kv-positions cache)."""
    if model.rotary is None:
        raise ValueError(f"{model.spec.architecture} has learned absolute positions, not RoPE, so its keys cannot "
                         "move to their places in the cache; pass --kv-positions absolute")
    if scaling_kind(model.spec.rope_scaling) == "longrope":
        raise ValueError("LongRoPE changes its frequencies at the original length, so a key cannot be turned to a "
                         "new position by one rotation; pass --kv-positions absolute")


def kv_layout(config: EngineConfig, spec: ModelSpec, storage: torch.dtype) -> KVLayout:
    """The pool's blocks and the longest sequence it serves, its elements in `storage` (ops/kv_int8.py).
    Raises ValueError when the pool holds no block or the KV window cannot work (the model slides on its own,
    or the pool is smaller than a window needs)."""
    block_size = config.cache.block_size
    bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * bytes_per_element_row(spec.head_dim, storage)
    num_blocks = config.cache.num_kv_blocks or config.cache.kv_cache_memory // (bytes_per_token * block_size)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {config.cache.kv_cache_memory} B holds no block of {block_size} "
                         f"tokens ({bytes_per_token * block_size} B); raise --kv-cache-memory")
    window, sinks = config.cache.kv_window, config.cache.kv_sinks
    if window is not None and spec.sliding_window:
        raise ValueError(f"{config.model.model} attends within its own sliding window of "
                         f"{spec.sliding_window} tokens ({len(spec.sliding_layers)} of "
                         f"{spec.num_layers} layers); --kv-window is for models with full attention")
    if window is not None and sinks == 0:
        raise ValueError(f"--kv-window {window} with --kv-sinks 0: a model trained with full attention leans on its "
                         "first tokens (attention sinks), and without them its perplexity breaks down once the window "
                         "passes them (StreamingLLM); keep --kv-sinks >= 1 (4 is the default)")
    if window is None and spec.kv_window:  # every layer slides: free the blocks the window has passed
        window, sinks = spec.kv_window, 0
    reindexed = reindexes_sinks(config, window, sinks)
    # a windowed sequence holds a bounded number of blocks, so only the positions limit its length
    per_sequence = (cdiv(sinks, block_size) * (2 if reindexed else 1) + 2 * cdiv(window, block_size) + 1
                    if window else None)
    if config.cache.kv_window is not None and per_sequence > num_blocks:
        raise ValueError(f"--kv-window {window} needs up to {per_sequence} KV blocks per sequence (sinks, "
                         f"window and one window-long chunk), but the pool has {num_blocks}; raise "
                         "--kv-cache-memory or lower --kv-window")
    bounded = per_sequence is not None and per_sequence <= num_blocks
    positions = servable_positions(spec.max_position_embeddings, spec.rope_scaling)
    limits = [positions] + ([] if bounded else [num_blocks * block_size])
    asked = config.scheduler.max_model_len
    if asked is not None and asked > positions and window is not None:
        # re-indexed, no query sees a key farther away than the sinks and the window; absolute, the sinks drift
        # past the trained distances (bench kv-positions measures what that costs)
        limits = [asked]
    elif asked is not None and asked > positions:
        if spec.rope_scaling:
            raise ValueError(f"--max-model-len {asked} is past the {positions} positions {config.model.model} serves "
                             f"with its {scaling_kind(spec.rope_scaling)} RoPE scaling; raise its factor "
                             "(--rope-scaling)")
        raise ValueError(f"--max-model-len {asked} is past the {positions} positions {config.model.model} was trained "
                         "for; a longer context needs a RoPE scaling that stretches them, e.g. --rope-scaling "
                         f"'{{\"rope_type\": \"yarn\", \"factor\": {math.ceil(asked / positions)}}}'")
    if asked is not None:
        limits.append(asked)
    return KVLayout(num_blocks, block_size, bytes_per_token, window, sinks, min(limits))


def load_model(config: EngineConfig, checkpoint: LoadedCheckpoint, dtype: torch.dtype, device: torch.device,
               max_model_len: int, use_kernel: bool | None) -> tuple[CausalLM, bool]:
    """The model, and whether its checkpoint was saved quantized (then it has no float weights to load).
    Raises ValueError when --quantization asks for other than what the checkpoint holds."""
    quantization, ready, tables = config.model.quantization, None, None
    saved = load_prequantized(checkpoint.hf_dir, checkpoint.weights)
    if saved is not None:
        if quantization not in (None, saved[0]):
            raise ValueError(f"{config.model.model} is already quantized to {saved[0]}; drop --quantization "
                             f"{quantization}")
        quantization, ready = None, saved[1]
    elif quantization == "gguf":
        quantization, ready, tables = None, *gguf_tensors(config.model.model, checkpoint.weights, device)
    elif quantization is None and hasattr(checkpoint.weights, "packed"):
        check_dense_copy(checkpoint.weights, dtype)
    spec = checkpoint.spec
    model = model_class(spec.architecture)(
        spec, checkpoint.weights, dtype, device, max_positions=max_model_len,
        use_kernel=use_kernel, quantization=quantization, group_size=config.model.quant_group_size,
        prequantized=ready, quantize_embedding=config.model.quantize_embedding, tables=tables,
        batch_invariant=config.model.batch_invariant,
        bf16_layout=None if config.model.bf16_layout == "auto" else config.model.bf16_layout)
    return model, saved is not None


def gguf_tensors(model: str, weights, device: torch.device):
    """(the file's quantized matrices, its embedding lookups) for --quantization gguf: a GGUF file's own tensors
    as they are (model/gguf/weights.py); a clear error for any other model."""
    packed = getattr(weights, "packed", None)
    if packed is None:
        path = resolve_model_path(model)
        if path.suffix.lower() == ".gguf":
            raise ValueError(f"--quantization gguf runs the quantized tensors of llama-architecture GGUF files; "
                             f"{path.name} is read through a converted copy: use int8 or int4")
        raise ValueError(f"--quantization gguf needs a .gguf model, and {model!r} is not one; use int8 or int4")
    return packed(cpu_kernels=device.type == "cpu"), weights.table


def check_dense_copy(weights, dtype: torch.dtype) -> None:
    """A GGUF file's quantized tensors read without --quantization are dequantized to `dtype` and kept so: say
    what that copy costs against the file, and refuse it, naming the fix, where it cannot fit in the memory
    available (an 8B Q4_K_M file is 4.9 GB; its float32 copy 32 GB)."""
    quantized = [name for name in weights if weights.is_quantized(name)]
    if not quantized:
        return
    dense = sum(math.prod(weights.shape(name)) for name in quantized) * torch.finfo(dtype).bits // 8
    held = sum(weights.tensor(name).data.nbytes for name in quantized)
    types = ", ".join(sorted({weights.tensor(name).type_name for name in quantized}))
    what = (f"{weights.file.path.name} holds {types} tensors ({held / 1e9:.2f} GB); without --quantization "
            f"they are dequantized to {str(dtype).removeprefix('torch.')} at load ({dense / 1e9:.2f} GB)")
    available = available_memory_bytes()
    if available is not None and dense > available:
        raise ValueError(f"{what}, more than the {available / 1e9:.1f} GB of memory available: serve the file's "
                         "own tensors with --quantization gguf")
    logger.info("%s; --quantization gguf serves them as they are", what)
