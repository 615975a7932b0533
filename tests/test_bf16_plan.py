"""A bf16 load that knows its kernel choice before it reads the weights (model/projection_kernels.py): every weight
is packed into the chosen layout as it is read, into the mapping a step streams, to the same bytes as a load that
reads everything plain first and packs after."""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from llmaccel import LLM
from llmaccel.model import projection_kernels
from llmaccel.model.weight_arena import LoadArena
from llmaccel.ops.kernel_choice import FORCE_ENV, LAYOUT_ENV, Bf16Choice, cached_bf16_choice, compact_available
from llmaccel.sampling_params import SamplingParams
from tests.tiny_gguf import write_gguf

pytestmark = pytest.mark.skipif(not compact_available(), reason="the compact layout's kernels are not built here")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A fresh timing cache per test (the kernels stay in the user's cache)."""
    from llmaccel.ops.cpu_kernels import load_cpu_kernels

    load_cpu_kernels()
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(LAYOUT_ENV, "compact")


def _load(model: str, monkeypatch) -> tuple[LLM, list[LoadArena], list]:
    """(the LLM, every load arena made while loading its model, what plan_bf16_before_reading gave)."""
    arenas, plans = [], []
    made = LoadArena.__init__

    def recording(self, nbytes):
        made(self, nbytes)
        arenas.append(self)

    planned = projection_kernels.plan_bf16_before_reading

    def plan(*args, **kwargs):
        plans.append(planned(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(LoadArena, "__init__", recording)
    monkeypatch.setattr("llmaccel.model.causal_lm.plan_bf16_before_reading", plan)
    llm = LLM(model=model, dtype="bfloat16", num_kv_blocks=16)
    monkeypatch.setattr(LoadArena, "__init__", made)
    return llm, arenas, plans


def _compact_weights(model) -> list[torch.Tensor]:
    return [m.compact for layer in model.layers for m in layer.projections] + [model.lm_head.compact]


@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_a_load_that_knows_the_cached_choice_packs_each_weight_as_it_reads_it(tiny_model_dirs, tiny_tokenizer,
                                                                              tmp_path, monkeypatch, form):
    """The first load times the kernels and reads every weight plain; the second finds the timing and reads only
    the first layer plain (the shapes to look it up by): the rest are packed straight into the compact mapping,
    in step order, to the first load's bytes; its logits are the first load's to the bit."""
    source = tiny_model_dirs["llama-tied"]
    model_path = str(source)
    if form == "gguf":
        config = json.loads((source / "config.json").read_text())
        model_path = str(write_gguf(source, tmp_path / "tiny-BF16.gguf", gguf.GGMLQuantizationType.BF16, config,
                                    tiny_tokenizer))
    first_llm, first_arenas, first_plans = _load(model_path, monkeypatch)
    from llmaccel.model.gguf.weights import GGUFWeights

    viewed, mapped = [], GGUFWeights.mapped
    monkeypatch.setattr(GGUFWeights, "mapped", lambda self, name: viewed.append(name) or mapped(self, name))
    second_llm, arenas, plans = _load(model_path, monkeypatch)
    first, second = first_llm.engine.runner.model, second_llm.engine.runner.model
    assert first_plans == [None]
    if form == "gguf":  # a matrix the file holds as the model does is packed from the mapped file, no copy between
        layers = range(1, len(first_llm.engine.runner.model.layers))
        assert viewed == [f"model.layers.{i}.{p}.weight" for i in layers for p in ("self_attn.o_proj", "mlp.down_proj")
                          ] + ["model.embed_tokens.weight"]
    plan = plans[0]
    assert plan is not None and plan.layers.layout == "compact" and plan.head.layout == "compact"
    plain, packed = arenas[0], plan.arena
    layer0 = sum(-(-m.out_features * m.in_features * 2 // 64) * 64 for m in second.layers[0].projections)
    assert plain.used == layer0  # the first layer alone was read plain (its pages handed back since)
    assert first_arenas[0].used > layer0 * len(first.layers)  # every layer and the head, the first time
    weights = _compact_weights(second)
    assert all(LoadArena.holding([w]) is packed for w in weights)
    for w, following in zip(weights, weights[1:], strict=False):  # back to back, as a step reads them
        assert following.data_ptr() == -(-(w.data_ptr() + w.nbytes) // LoadArena.ALIGN) * LoadArena.ALIGN
    for got, want in zip(weights, _compact_weights(first), strict=True):
        assert torch.equal(got, want)
    ids = torch.tensor([3, 17, 29, 4, 101])
    assert torch.equal(second.lm_head.rows(ids), first.lm_head.rows(ids))
    prompt, greedy = tiny_tokenizer.encode("The quick brown fox"), SamplingParams(temperature=0, max_tokens=12,
                                                                                    ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in second_llm.generate([prompt], greedy)]
            == [o.outputs[0].token_ids for o in first_llm.generate([prompt], greedy)])


def test_the_cached_choice_is_none_until_timed_then_the_timings_own(tiny_model_dirs, monkeypatch):
    """Looked up by the shapes a load knows before reading (a layer's projections, the head, the decode count), the
    choice is the one the first load timed and wrote; a forced kernel needs no timing."""
    model = _load(str(tiny_model_dirs["llama-tied"]), monkeypatch)[0].engine.runner.model
    shapes = [(m.out_features, m.in_features) for m in model.layers[0].projections]
    head = (model.lm_head.out_features, model.lm_head.in_features)
    count = len(shapes) * len(model.layers)  # a tiny model's decode timing streams every layer
    found = cached_bf16_choice(shapes, head, count)
    assert found is not None and found == (model.layers[0].qkv.bf16_choice, model.lm_head.bf16_choice)
    assert cached_bf16_choice(shapes, head, count - 1) is None  # another key: not timed
    assert cached_bf16_choice(shapes, None, count) is None
    monkeypatch.setenv(FORCE_ENV, "compact_stream")
    forced = Bf16Choice(((1 << 30, "compact_stream"),), "compact")
    assert cached_bf16_choice(shapes, head, 1) == (forced, forced)
    assert cached_bf16_choice(shapes, None, 1) == (forced, None)


def test_a_plan_looked_up_for_other_shapes_than_the_model_built_is_an_error(tiny_model_dirs, monkeypatch):
    model = _load(str(tiny_model_dirs["llama-tied"]), monkeypatch)[0].engine.runner.model
    choice = model.layers[0].qkv.bf16_choice
    shapes = tuple((m.out_features, m.in_features) for m in model.layers[0].projections)
    plan = projection_kernels.Bf16Plan(choice, choice, (shapes, (7, 64)), None)
    with pytest.raises(RuntimeError, match="before the weights were read"):
        projection_kernels.choose_bf16_kernels(model, plan=plan)
