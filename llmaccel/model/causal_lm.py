"""What every model family shares: weights from the checkpoint, embedding and LM head, the layer loop over a
flattened batch with paged KV, and logits (the CPU projections' kernel choice: model/projection_kernels.py).

A family (model/llama.py, qwen3.py, gemma.py, phi3.py, gpt2.py) subclasses `CausalLM` with its `read_spec`
and `build_layer`. A layer is called as `layer(hidden, residual, positions, rotary, attention, kv_cache,
meta) -> (hidden, residual)`: `hidden` is the previous layer's output not yet added to the residual stream
(None residual at the first layer), so each add folds into the norm after it; `projections` lists its linear
modules in the order a step reads them. The model sees `[total_tokens, hidden]`; the LM head runs only on
the rows that are sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from llmaccel.errors import CorruptCheckpointError
from llmaccel.model.layer_taps import LayerTaps
from llmaccel.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, build_linear
from llmaccel.model.projection_kernels import choose_bf16_kernels, choose_quantized_kernels, plan_bf16_before_reading
from llmaccel.model.spec import ModelSpec
from llmaccel.model.step_interrupt import StepInterrupt
from llmaccel.model.weight_arena import LoadArena, return_freed_memory
from llmaccel.ops.attention import AttentionMetadata, PagedAttention
from llmaccel.ops.kernel_choice import Bf16Choice
from llmaccel.ops.kquant_linear import ConcatLinear
from llmaccel.ops.quant_linear import quantized_linear
from llmaccel.quantization.formats import (
    Int4Weight,
    Int8Weight,
    PackedWeight,
    concat_weights,
    quantize_int8,
    same_format,
)

Ready = Int4Weight | Int8Weight | PackedWeight


class WeightLoader:
    """Named checkpoint tensors, cast and placed (a missing one is an error naming it), and the projections
    built from them: dense, quantized at load (`quantization`), or the checkpoint's own quantized weights
    (`prequantized`, by tensor name; a Mapping that may build each when asked, and give None for one it
    cannot) used as they are. `tables`: the checkpoint's own embedding lookups (a GGUF file's quantized rows)."""

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 quantization: str | None = None, group_size: int | None = None,
                 prequantized: Mapping[str, Ready | None] | None = None,
                 tables: Callable[[str], nn.Module | None] | None = None) -> None:
        self.weights, self.dtype, self.device = weights, dtype, device
        self.quantization, self.group_size = quantization, group_size
        self.prequantized = prequantized or {}
        self.tables = tables
        self._arena: LoadArena | None = None
        # (choice, arena): each matrix `placed` reads is moved into the choice's layout as it is read, written into
        # the arena (model/projection_kernels.plan_bf16_before_reading); None: read plain, in place
        self.packing: tuple[Bf16Choice, LoadArena | None] | None = None
        self._scratch: torch.Tensor | None = None  # where a matrix to be packed is read, reused matrix to matrix

    def __contains__(self, name: str) -> bool:
        return name in self.weights or name in self.prequantized

    def __call__(self, name: str) -> torch.Tensor:
        return self.stored(name).to(device=self.device, dtype=self.dtype).contiguous()

    def stored(self, name: str) -> torch.Tensor:
        """The named tensor as the checkpoint stores it (after the family's layout fix), on the CPU."""
        if name not in self.weights:
            raise CorruptCheckpointError(f"checkpoint has no tensor {name!r}")
        return self.prepare(name, self.weights[name])

    def shape(self, name: str) -> tuple[int, ...]:
        reader = getattr(self.weights, "shape", None)
        return tuple(reader(name)) if callable(reader) else tuple(self.weights[name].shape)

    def prepare(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A family's own layout fix (GPT-2 transposes its Conv1D weights); as stored by default."""
        return tensor

    def cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self(n) for n in names], dim=0)

    def linear(self, names: list[str], bias: torch.Tensor | None, name: str) -> nn.Module:
        """One projection from the named weights stacked (q, k and v into one matmul, say). Parts the checkpoint
        holds in different quantized formats (a GGUF file's q and k in Q4_K, its v in Q6_K) stay apart, each
        run by its own kernel, in one ConcatLinear."""
        ready = [self.prequantized.get(n) for n in names]
        if all(w is not None for w in ready) and same_format(ready):
            return quantized_linear(concat_weights(ready), bias, self.device)
        if any(w is not None for w in ready):
            parts = [quantized_linear(w, None, self.device) if w is not None else self.dense([n], None, name)
                     for n, w in zip(names, ready, strict=True)]
            return ConcatLinear(parts, bias)
        return self.dense(names, bias, name)

    def dense(self, names: list[str], bias: torch.Tensor | None, name: str, quantize: bool = True) -> nn.Module:
        """A dense projection, or quantized at load (`quantization`, unless not `quantize`: the tables). In a
        float32 CPU model, bfloat16 / float16 checkpoint weights stay in their dtype (half-precision panels,
        widened as they are read: model/layers.Linear)."""
        if not quantize and self.quantization is not None:
            return Linear(self.cat(names), bias)
        placed = self.placed(names) if self.quantization is None else None
        if placed is not None:
            linear = Linear(placed, bias)
            if self.packing is not None:
                linear.set_bf16_choice(*self.packing)
                done = getattr(self.weights, "done", None)
                for name_read in names if callable(done) else ():
                    done(name_read)
            return linear
        stored = [self.stored(n) for n in names]
        if (self.quantization is None and self.dtype == torch.float32 and self.device.type == "cpu"
                and len({t.dtype for t in stored}) == 1 and stored[0].dtype in (torch.bfloat16, torch.float16)):
            return Linear(torch.cat(stored, dim=0).contiguous(), bias, keep_half=True)
        return build_linear(self.cat(names), bias, self.quantization, self.group_size, name)

    def placed(self, names: list[str]) -> torch.Tensor | None:
        """The named matrices stacked, each read from the checkpoint straight into its rows of one huge-page
        mapping (model/weight_arena.LoadArena), in the order the model asks for them: a bf16 CPU model's dense
        weights, written once where the decode step streams them, with no clone, concatenation or later copy
        beside them. None where that does not apply (another dtype or device, a family's own layout fix). While
        `packing`, `dense` packs them into the chosen layout from a scratch buffer they are read into, or from the
        mapped file itself where it holds one matrix as the model does (the o and down projections, the LM head)."""
        if (self.device.type != "cpu" or self.dtype != torch.bfloat16
                or type(self).prepare is not WeightLoader.prepare):
            return None
        shapes = [self.shape(n) for n in names]
        if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
            return None
        rows = [s[0] for s in shapes]
        itemsize = self.dtype.itemsize
        nbytes = sum(rows) * shapes[0][1] * itemsize
        if self.packing is not None and len(names) == 1:  # packed from the mapped file where it is held as is
            mapped = getattr(self.weights, "mapped", None)
            view = mapped(names[0]) if callable(mapped) else None
            if view is not None and view.dtype == self.dtype and tuple(view.shape) == shapes[0]:
                return view
        if self.packing is not None:
            place = self._scratch_bytes(nbytes)
        else:
            if self._arena is None:  # a reservation: pages cost memory only once written
                self._arena = LoadArena(self._dense_bytes())
            place = self._arena.take((nbytes,))
            if place is None:
                return None
        weight = place.view(self.dtype).view(sum(rows), shapes[0][1])
        reader = getattr(self.weights, "read_into", None)
        for name, part in zip(names, weight.split(rows), strict=True):
            if callable(reader):
                reader(name, part)
            else:
                part.copy_(self.stored(name))
        return weight

    def _scratch_bytes(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the scratch buffer, grown where too small: the same pages for every matrix, so the kernel
        zeroes fresh pages only for the largest one (the LM head), not for the whole model."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _dense_bytes(self) -> int:
        """An upper bound on the bytes of the matrices `placed` can be asked for: every 2-D checkpoint tensor
        not taken in its own quantized format, each aligned as the arena hands them out."""
        align, total = LoadArena.ALIGN, 0
        for name in self.weights:
            shape = self.shape(name)
            if len(shape) == 2 and name not in self.prequantized:
                total += -(-shape[0] * shape[1] * self.dtype.itemsize // align) * align
        return total

    def head(self, name: str) -> nn.Module:
        """The LM head from the named matrix: the checkpoint's own quantized format where it has one."""
        ready = self.prequantized.get(name)
        return quantized_linear(ready, None, self.device) if ready is not None else self.dense([name], None, name)

    def table(self, name: str) -> nn.Module | None:
        """The checkpoint's own lookup for the named embedding table, or None where it is to be built here."""
        return self.tables(name) if self.tables is not None else None

    def int8_table(self, name: str) -> nn.Module:
        ready = self.prequantized.get(name)
        return quantized_linear(ready if isinstance(ready, Int8Weight) else quantize_int8(self(name)), None,
                                self.device)

    def norm(self, name: str, eps: float, offset: float = 0.0) -> RMSNorm:
        """An RMSNorm with the named weight (+ `offset`: Gemma stores w for a scale of 1 + w)."""
        if name not in self.weights:
            raise CorruptCheckpointError(f"checkpoint has no tensor {name!r}")
        weight = self.weights[name].float() + offset  # in float32, as Gemma adds it, then cast
        norm = RMSNorm(weight.shape[-1], eps)
        norm.weight.data = weight.to(device=self.device, dtype=self.dtype).contiguous()
        return norm


class CausalLM(nn.Module):
    embed_name = "model.embed_tokens.weight"
    head_name = "lm_head.weight"
    final_norm_name = "model.norm.weight"
    norm_offset = 0.0  # Gemma's (1 + w) norms
    loader_class = WeightLoader
    # decode-only steps through the C++ decode stack (model/decode_stack.py): Llama-shaped layers only
    uses_decode_stack = False
    adapters = None  # LoRA adapters' rows of the pass (lora/layers.LoRABatch) when served

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        raise NotImplementedError

    def __init__(self, spec: ModelSpec, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, use_kernel: bool | None = None,
                 quantization: str | None = None, group_size: int | None = None,
                 prequantized: Mapping[str, Ready | None] | None = None,
                 quantize_embedding: bool = False, tables: Callable[[str], nn.Module | None] | None = None,
                 batch_invariant: bool = False, bf16_layout: str | None = None) -> None:
        """`quantization` (int8 / int4) applies to every decoder linear layer. The embedding and the LM
        head stay in `dtype` (mixed precision, as weight-only schemes recommend) unless
        `quantize_embedding`: then they are INT8 per row, and a tied pair shares one INT8 copy.
        `prequantized` gives ready INT8/INT4 weights by tensor name (a GGUF file's own, or a saved
        quantized checkpoint's), used as they are where present; `tables` the file's own embedding lookups.
        `batch_invariant`: the bf16 projections and head run only the kernels that sum a row in one order at any
        row count (ops/kernel_choice.py). `bf16_layout`: the bf16 weights' layout (plain, vnni, compact), else the
        fastest one timed here."""
        super().__init__()
        self.spec = spec
        take = self.loader_class(weights, dtype, device, quantization, group_size, prequantized, tables)
        self.embed_name, self.head_name, self.final_norm_name = self.weight_names(take)
        bf16_kernels = device.type == "cpu" and dtype == torch.bfloat16 and use_kernel is not False
        plan = None  # the bf16 kernel choice, where it is known before the weights are read
        layers = []
        for i in range(spec.num_layers):
            layers.append(self.build_layer(i, take))
            if i == 0 and bf16_kernels and type(self).build_embedding is CausalLM.build_embedding:
                plan = plan_bf16_before_reading(self, take, layers[0], self.plain_head_shape(take, quantize_embedding),
                                                batch_invariant, bf16_layout)
            return_freed_memory()  # a layer's load temporaries (quantized at load, say) leave no resident heap
        self.layers = nn.ModuleList(layers)
        take.packing = plan.head_packing() if plan is not None else None
        self.build_embedding(take, quantize_embedding)  # after the layers: a step reads the LM head last
        take.packing = None
        self.norm = self.build_final_norm(take)
        self.rotary = self.build_rotary(max_positions, dtype, device)
        self.attention = PagedAttention(spec.num_heads, spec.num_kv_heads, spec.head_dim, device, use_kernel,
                                        scale=spec.attention_scale, softcap=spec.attn_softcap)
        compact_arena = None  # alive until the decode stack has found its weights there (nothing else holds it)
        if bf16_kernels:
            compact_arena = choose_bf16_kernels(self, batch_invariant, bf16_layout, plan)
            choose_quantized_kernels(self)
            return_freed_memory()  # the timing's inputs and layout copies (~1 GB at 8B) leave no resident heap
        self.decode_stack = None
        if self.uses_decode_stack and device.type == "cpu" and use_kernel is not False:
            from llmaccel.model.decode_stack import build_decode_stack

            self.decode_stack = build_decode_stack(self)  # None: layer by layer (the reason logged)
        del compact_arena

    def weight_names(self, take: WeightLoader) -> tuple[str, str, str]:
        """(embedding, LM head, final norm) tensor names in this checkpoint."""
        return self.embed_name, self.head_name, self.final_norm_name

    def build_embedding(self, take: WeightLoader, quantize_embedding: bool) -> None:
        """`self.embedding` and `self.lm_head`: one copy when tied, where the layout can be read by rows."""
        spec = self.spec
        shape = take.shape(self.embed_name) if self.embed_name in take.weights else None
        if shape is not None and shape != (spec.vocab_size, spec.hidden_size):
            raise CorruptCheckpointError(f"tensor {self.embed_name!r} is {shape}, but config.json gives "
                                         f"vocab_size x hidden_size = ({spec.vocab_size}, {spec.hidden_size})")
        tied = spec.tie_word_embeddings or self.head_name not in take
        rows = take.table(self.embed_name)
        if rows is not None:  # the file's own quantized rows for lookups; the head in its own format
            self.embedding = rows
            self.lm_head = take.head(self.embed_name if tied else self.head_name)
            return
        if quantize_embedding or self.embed_name in take.prequantized:
            self.embedding = take.int8_table(self.embed_name)
        elif tied:
            table = take.dense([self.embed_name], None, self.embed_name, quantize=False)
            self.embedding = table if table.has_rows else Embedding(take(self.embed_name))
        else:
            self.embedding = Embedding(take(self.embed_name))
        if tied:
            self.lm_head = table if isinstance(self.embedding, Embedding) else self.embedding
        elif isinstance(self.embedding, Embedding):
            self.lm_head = take.dense([self.head_name], None, self.head_name, quantize=False)
        else:
            self.lm_head = take.int8_table(self.head_name)

    def plain_head_shape(self, take: WeightLoader, quantize_embedding: bool) -> tuple[int, int] | None:
        """The shape of the LM head `build_embedding` will make a dense Linear of, read in place in this dtype (the
        one the bf16 kernel choice is made for); None where it will be quantized or the file's own format."""
        tied = self.spec.tie_word_embeddings or self.head_name not in take
        name = self.embed_name if tied else self.head_name
        if take.quantization is not None or name in take.prequantized:
            return None
        if take.table(self.embed_name) is None and (quantize_embedding or self.embed_name in take.prequantized):
            return None
        return take.shape(name)

    def build_layer(self, i: int, take: WeightLoader) -> nn.Module:
        raise NotImplementedError

    def build_final_norm(self, take: WeightLoader) -> nn.Module:
        return take.norm(self.final_norm_name, self.spec.rms_norm_eps, self.norm_offset)

    def build_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        spec = self.spec
        return RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling, dtype,
                               spec.max_position_embeddings).to(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first layer's input; an INT8 table's rows come back in float32: the stream runs in the model's dtype."""
        return self.embedding.rows(input_ids).to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], taps: LayerTaps | None = None,
                interrupt: StepInterrupt | None = None) -> torch.Tensor | None:
        """The final normed hidden states, [tokens, hidden]. `taps` read the stream after chosen layers
        (the decode stack, which keeps it inside C++, is then not used); with `taps.stop` the pass ends
        after the last of them and returns None. `interrupt`: raised by another thread, the pass stops at the
        next layer boundary with StepInterrupted (model/step_interrupt.py)."""
        if self.decode_stack is not None and taps is None:
            normed = self.decode_stack.decode(self, input_ids, positions, meta, kv_caches, interrupt)
            if normed is not None:
                return normed
        if taps is not None and taps.last >= len(self.layers):
            raise ValueError(f"layer {taps.last} tapped, but the model has {len(self.layers)} layers")
        hidden, residual = self.embed(input_ids, positions), None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if interrupt is not None:
                interrupt.check()
            hidden, residual = layer(hidden, residual, positions, self.rotary, self.attention, kv_cache, meta)
            if taps is not None and i in taps.layers:
                taps.take(hidden, residual)
                if taps.stop and i == taps.last:
                    return None
        return self.norm.add_forward(hidden, residual)[0] if residual is not None else self.norm(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; an INT8/INT4 head's kernel sums in float32 and hands them over unrounded. Gemma 2
        caps them (cap * tanh(logits / cap)), as HF does before sampling."""
        if hasattr(self.lm_head, "float_forward"):
            logits = self.lm_head.float_forward(hidden)
        else:
            logits = self.lm_head(hidden).float()
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap).mul_(cap)
