"""Phi-3 (and Phi-3.5): the Llama layer, its q/k/v and gate/up projections stored fused, LongRoPE scaling.

Loaded, the layers are the Llama family's, so decode steps run the C++ decode stack as Llama's do. LongRoPE's
short factors rotate positions within `original_max_position_embeddings`, the long ones those past it
(model/rope.rope_tables). A partial rotary factor (Phi-4-mini) is refused: the kernels rotate whole heads.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from llmaccel.errors import UnsupportedModelError
from llmaccel.model.causal_lm import CausalLM, WeightLoader
from llmaccel.model.layers import GatedMLP
from llmaccel.model.llama import DecoderLayer
from llmaccel.model.spec import ModelSpec, config_fields, llama_spec


class Phi3ForCausalLM(CausalLM):
    uses_decode_stack = True

    @classmethod
    def read_spec(cls, config: dict, source: str) -> ModelSpec:
        spec = llama_spec({**config, "model_type": "phi3"}, source, "Phi3ForCausalLM")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
            raise UnsupportedModelError(f"{source}: partial_rotary_factor < 1 (rotating part of each head) is not "
                                        "supported; llmaccel rotates whole heads")
        scaling = spec.rope_scaling
        if scaling and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
            with config_fields(source):
                original = scaling.get("original_max_position_embeddings",
                                       config["original_max_position_embeddings"])
                scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": int(original),
                           "max_position_embeddings": spec.max_position_embeddings}
                for key in ("short_factor", "long_factor"):
                    if len(scaling[key]) != spec.head_dim // 2:
                        raise ValueError(f"rope {key} has {len(scaling[key])} values, not head_dim / 2 = "
                                         f"{spec.head_dim // 2}")
            return replace(spec, rope_scaling=scaling)
        return spec

    def build_layer(self, i: int, take: WeightLoader) -> nn.Module:
        spec, p = self.spec, f"model.layers.{i}."
        qkv = take.linear([p + "self_attn.qkv_proj.weight"], None, p + "self_attn.qkv")
        o = take.linear([p + "self_attn.o_proj.weight"], None, p + "self_attn.o_proj")
        mlp = GatedMLP(take.linear([p + "mlp.gate_up_proj.weight"], None, p + "mlp.gate_up"),
                       take.linear([p + "mlp.down_proj.weight"], None, p + "mlp.down_proj"))
        return DecoderLayer(spec, qkv, o, mlp, take.norm(p + "input_layernorm.weight", spec.rms_norm_eps),
                            take.norm(p + "post_attention_layernorm.weight", spec.rms_norm_eps), spec.layer_window(i))
