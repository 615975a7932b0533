"""Many LoRA adapters in one batch: greedy tokens equal HF + PEFT's (unmerged and merged) for every adapter at once,
beside base-model requests; exact stacked-matrix placement; the errors a bad adapter gives."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from llmaccel.errors import InvalidRequestError
from llmaccel.llm import LLM
from llmaccel.lora.adapter import AdapterError, LoRAPiece
from llmaccel.lora.layers import LoRABatch, LoRALinear
from llmaccel.model.layers import build_linear
from llmaccel.model.loader import hf_dir_for
from llmaccel.ops.gemv import gemv_kernels
from llmaccel.sampling_params import SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# three adapters of different ranks, targets and scalings
ADAPTERS = {"r4-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "r8-all": dict(r=8, lora_alpha=16, target_modules=ALL),
            "r16-rs": dict(r=16, lora_alpha=32, target_modules=ALL, use_rslora=True)}
PROMPTS = ["The quick brown fox", "What is the capital of France?", "def hello():", "你好，世界！"]
GREEDY = dict(temperature=0, max_tokens=16, ignore_eos=True)


def make_adapter(base_dir, out, seed: int, b_scale: float = 0.3, **options) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():  # PEFT's random init of B is as large as A's: scaled down, the deltas steer, not swamp
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    peft.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(llama_dir, root / name, seed, **options)
            for seed, (name, options) in enumerate(ADAPTERS.items())}


def peft_greedy(base_dir, adapter_dir, prompts: list[list[int]], merge: bool, max_new_tokens: int = 16
                ) -> list[list[int]]:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      adapter_dir).eval()
    if merge:
        model = model.merge_and_unload()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def expected(llama_dir, adapters, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode(p) for p in PROMPTS]
    unmerged = {name: peft_greedy(llama_dir, path, prompts, merge=False) for name, path in adapters.items()}
    merged = {name: peft_greedy(llama_dir, path, prompts, merge=True) for name, path in adapters.items()}
    return prompts, unmerged, merged


@pytest.fixture(scope="module")
def llm(llama_dir, adapters):
    return LLM(str(llama_dir), lora_modules=adapters, max_loras=4, max_lora_rank=16)


def test_every_adapter_and_the_base_in_one_batch_match_hf_peft(llm, expected):
    prompts, unmerged, merged = expected
    assert unmerged == merged  # the oracle agrees with itself in float32
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
    assert all(unmerged[name] != base for name in ADAPTERS)  # each adapter changes the answers
    names = [None, *ADAPTERS]
    batch = [(ids, name) for ids in prompts for name in names]  # every prompt with every adapter, interleaved
    outputs = llm.generate([ids for ids, _ in batch], [SamplingParams(**GREEDY, lora=name) for _, name in batch])
    got = {(i // len(names), name): o.outputs[0].token_ids
           for i, ((_, name), o) in enumerate(zip(batch, outputs, strict=True))}
    for p in range(len(prompts)):
        assert got[(p, None)] == base[p]
        for name in ADAPTERS:
            assert got[(p, name)] == unmerged[name][p], (p, name)


@pytest.mark.skipif(gemv_kernels() is None, reason="no CPU kernels")
def test_the_cpu_kernel_names_a_slot_or_part_it_cannot_read():
    kernels = gemv_kernels()
    y, x = torch.zeros(2, 8), torch.zeros(2, 4)
    a, b_t = torch.zeros(6, 4), torch.zeros(6, 8)  # 3 slots of share 2
    parts = torch.tensor([[0, 8]])
    with pytest.raises(RuntimeError, match="row 1's adapter slot 3 is outside 0..2"):
        kernels.lora_add_(y, x, a, b_t, torch.tensor([0, 3]), 2, parts)
    with pytest.raises(RuntimeError, match="part 0's columns are outside 0..8"):
        kernels.lora_add_(y, x, a, b_t, torch.tensor([0, 1]), 2, torch.tensor([[0, 9]]))
    with pytest.raises(RuntimeError, match="whole shares"):
        kernels.lora_add_(y, x, a, b_t, torch.tensor([0, 1]), 4, torch.tensor([[0, 8]]))
    kernels.lora_add_(y, x, a, b_t, torch.tensor([-1, 2]), 2, parts)  # in range: no error


def test_decode_steps_with_adapter_rows_run_in_the_decode_stack_as_the_layers_run_them(llm, expected, monkeypatch):
    """The C++ decode stack holds every projection's adapters (csrc/lora.h) and takes the steps whose rows carry
    them; the same batch decoded layer by layer (the stack told it holds none) gives the same tokens."""
    prompts, unmerged, _ = expected
    stack = llm.engine.runner.model.decode_stack
    assert stack is not None and stack.lora
    calls = []
    monkeypatch.setattr(stack, "stack", _Recording(stack.stack, calls))
    names = [None, *ADAPTERS]
    params = [SamplingParams(**GREEDY, lora=name) for _ in prompts for name in names]
    in_stack = [o.outputs[0].token_ids for o in llm.generate([ids for ids in prompts for _ in names], params)]
    assert any(slots is not None and (slots >= 0).any() for slots in calls)  # adapter rows went through the stack
    monkeypatch.setattr(stack, "lora", False)
    calls.clear()
    layered = [o.outputs[0].token_ids for o in llm.generate([ids for ids in prompts for _ in names], params)]
    assert layered == in_stack
    assert all(slots is None for slots in calls)


class _Recording:
    """The C++ stack, each forward's lora_slots noted."""

    def __init__(self, stack, calls: list) -> None:
        self._stack, self._calls = stack, calls

    def forward(self, *args):
        self._calls.append(args[-1])
        return self._stack.forward(*args)

    def __getattr__(self, name):
        return getattr(self._stack, name)


def test_chunked_prefill_and_a_decode_only_batch_match_too(llama_dir, adapters, expected):
    prompts, unmerged, _ = expected
    llm = LLM(str(llama_dir), lora_modules=adapters, max_lora_rank=16, max_num_batched_tokens=4)
    outputs = llm.generate(prompts, [SamplingParams(**GREEDY, lora="r16-rs")] * len(prompts))
    assert [o.outputs[0].token_ids for o in outputs] == unmerged["r16-rs"]


def test_an_adapter_does_not_reuse_the_base_models_cached_prefix(llm, expected):
    prompts, unmerged, _ = expected
    long_prompt = prompts[1][::-1] * 4  # whole blocks, and no request of the other tests begins so
    llm.generate([long_prompt], SamplingParams(**GREEDY))
    hits = llm.engine.prefix_cache_stats.hits
    llm.generate([long_prompt], SamplingParams(**GREEDY, lora="r8-all"))
    assert llm.engine.prefix_cache_stats.hits == hits  # the adapter's KV differs from the base model's
    llm.generate([long_prompt], SamplingParams(**GREEDY, lora="r8-all"))
    assert llm.engine.prefix_cache_stats.hits > hits  # ... and its own is reused


def test_the_stacked_matrices_hold_each_adapter_in_its_slot(llm, adapters):
    manager = llm.engine.loras
    assert manager.slots == {"r4-qv": 0, "r8-all": 1, "r16-rs": 2}
    qkv = manager.modules[1]["qkv"]
    tensors = load_file(f"{adapters['r4-qv']}/adapter_model.safetensors")
    a_v = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"]
    b_v = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    share, rank = qkv.share, qkv.max_rank  # slot 0's share: q's columns 0..15, k's 16..31, v's 32..47
    assert share == 48
    assert torch.equal(qkv.a[32:36], a_v)
    assert torch.equal(qkv.a[36:48], torch.zeros(12, 64))  # rank 4 of 16: the rest stays zero
    q, kv = 64, 32  # v's rows of the fused projection: after q's 64 and k's 32
    assert torch.allclose(qkv.b_t[32:36, q + kv:q + 2 * kv], b_v.t() * (8 / 4))
    assert torch.equal(qkv.b_t[16:32], torch.zeros(16, q + 2 * kv))  # k is not a target of this adapter
    assert not qkv.b_t[rank * 3:share * 2].eq(0).all()  # slot 1 (r8-all) targets k


def test_load_and_unload_at_run_time(llama_dir, adapters, expected):
    prompts, unmerged, _ = expected
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'r8-all'"):
        llm.generate(prompts[:1], SamplingParams(**GREEDY, lora="r8-all"))
    llm.engine.add_lora("r8-all", adapters["r8-all"])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY, lora="r8-all"))] \
        == unmerged["r8-all"]
    with pytest.raises(AdapterError, match=r"1 LoRA adapters are loaded \(--max-loras\)"):
        llm.engine.add_lora("r4-qv", adapters["r4-qv"])
    llm.engine.remove_lora("r8-all")
    assert all(torch.equal(m.a, torch.zeros_like(m.a)) for layer in llm.engine.loras.modules for m in layer.values())
    llm.engine.add_lora("r4-qv", adapters["r4-qv"])  # the freed slot takes another
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY, lora="r4-qv"))] \
        == unmerged["r4-qv"]


def test_an_adapter_in_use_is_not_unloaded(llm, expected):
    prompts, _, _ = expected
    llm.engine.add_request("busy", prompts[0], SamplingParams(**GREEDY, lora="r4-qv"))
    with pytest.raises(InvalidRequestError, match="'r4-qv' is in use by 1 request"):
        llm.engine.remove_lora("r4-qv")
    llm.engine.abort_request("busy")


def _copy(adapter: str, tmp_path, name: str):
    out = tmp_path / name
    shutil.copytree(adapter, out)
    return out


def test_bad_adapters_are_named_errors(llama_dir, adapters, tmp_path):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8)
    add = llm.engine.add_lora
    with pytest.raises(AdapterError, match="no such directory"):
        add("x", str(tmp_path / "absent"))
    missing = _copy(adapters["r4-qv"], tmp_path, "missing")
    (missing / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        add("x", str(missing))
    with pytest.raises(AdapterError, match=r"rank 16 is over --max-lora-rank 8"):
        add("x", adapters["r16-rs"])
    wrong = _copy(adapters["r4-qv"], tmp_path, "wrong-shape")  # an adapter for a wider model
    tensors = load_file(wrong / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[key] = torch.zeros(4, 128)
    save_file(tensors, wrong / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"layer 0's q_proj is A \(4, 128\).*needs A \(rank, 64\)"):
        add("x", str(wrong))
    dora = _copy(adapters["r4-qv"], tmp_path, "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA is not supported"):
        add("x", str(dora))
    assert llm.engine.lora_adapters == {}  # nothing half-loaded
    add("ok", adapters["r4-qv"])  # and the engine still loads a good one
    assert list(llm.engine.lora_adapters) == ["ok"]


def test_lora_needs_a_llama_shaped_model(tiny_model_dirs):
    with pytest.raises(AdapterError, match="Llama-shaped model"):
        LLM(str(tiny_model_dirs["gpt2"]), enable_lora=True)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_the_deltas_ride_on_any_base_format(quantization):
    """Rows without an adapter are the base projection's exactly; rows with one add B A x (any base: dense, INT8,
    INT4), the adapter's own slot picked by the mask."""
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    base = build_linear(weight, None, quantization, 32, "probe")
    batch = LoRABatch(torch.device("cpu"), torch.float32)
    module = LoRALinear(base, batch, "o", max_loras=3, max_rank=8, in_features=64, out_features=96)
    pieces = {slot: LoRAPiece(0, "o", 0, 0, torch.randn(rank, 64), torch.randn(96, rank) * 0.1)
              for slot, rank in ((0, 4), (2, 8))}
    for slot, piece in pieces.items():
        module.load(slot, piece)
    x = torch.randn(5, 64)
    batch.set_rows([2, -1, 0, 2, -1])
    got, plain = module(x), base(x)
    for row, slot in enumerate([2, -1, 0, 2, -1]):
        if slot < 0:
            assert torch.equal(got[row], plain[row])
        else:
            delta = pieces[slot].b @ (pieces[slot].a @ x[row])
            assert torch.allclose(got[row], plain[row] + delta, atol=1e-4)
    batch.set_rows([-1] * 5)
    assert not batch.active and torch.equal(module(x), plain)


@pytest.mark.skipif(gemv_kernels() is None, reason="no CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernel_adds_what_the_batched_matmuls_add(dtype):
    """csrc/lora.cpp against the torch ops on a fused q/k/v projection (three parts, each adapter row touching its
    own part's columns only): rows without an adapter untouched to the bit, the others the same sums (float32)
    or within a bfloat16 rounding of them."""
    torch.manual_seed(1)
    base = build_linear(torch.randn(48, 32).to(dtype), None, None, 32, "probe")
    batch = LoRABatch(torch.device("cpu"), dtype)
    kernel = LoRALinear(base, batch, "qkv", max_loras=3, max_rank=4, in_features=32, out_features=48)
    for slot, rank in ((0, 2), (2, 4)):
        for part, (start, rows) in enumerate(((0, 24), (24, 12), (36, 12))):
            kernel.load(slot, LoRAPiece(0, "qkv", part, start, torch.randn(rank, 32).to(dtype),
                                        (torch.randn(rows, rank) * 0.1).to(dtype)))
    assert kernel.part_columns.tolist() == [[0, 24], [24, 36], [36, 48]]
    reference = LoRALinear(base, batch, "qkv", max_loras=3, max_rank=4, in_features=32, out_features=48)
    reference.a.copy_(kernel.a), reference.b_t.copy_(kernel.b_t)
    reference._kernels = None
    x = torch.randn(6, 32).to(dtype)
    slots = [2, -1, 0, 2, -1, 0]
    batch.set_rows(slots)
    got, want, plain = kernel(x), reference(x), base(x)
    assert kernel._kernels is not None
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(got[row], plain[row])
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-3).all()
        assert (got != plain).any()


def test_an_int8_base_serves_adapters_beside_its_own_rows(llama_dir, adapters, expected):
    prompts, _, _ = expected
    llm = LLM(str(llama_dir), quantization="int8", lora_modules=adapters, max_lora_rank=16)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(**GREEDY))]
    mixed = llm.generate(prompts * 2, [SamplingParams(**GREEDY)] * len(prompts)
                         + [SamplingParams(**GREEDY, lora="r8-all")] * len(prompts))
    assert [o.outputs[0].token_ids for o in mixed[:len(prompts)]] == base
    assert [o.outputs[0].token_ids for o in mixed[len(prompts):]] != base


@pytest.mark.slow
def test_the_default_model_serves_three_adapters_in_one_batch_as_peft(tmp_path):
    hf = hf_dir_for("smollm2-135m")
    adapters = {name: make_adapter(hf, tmp_path / name, seed, b_scale=0.05, **options)
                for seed, (name, options) in enumerate(ADAPTERS.items())}
    llm = LLM("smollm2-135m", lora_modules=adapters, max_lora_rank=16)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "请用一句话介绍长城。")]
    want = {name: peft_greedy(hf, path, prompts, merge=False, max_new_tokens=24) for name, path in adapters.items()}
    merged = {name: peft_greedy(hf, path, prompts, merge=True, max_new_tokens=24) for name, path in adapters.items()}
    assert merged == want
    names = [None, *ADAPTERS]
    outputs = llm.generate(prompts * len(names), [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                  lora=name) for name in names for _ in prompts])
    got = [o.outputs[0].token_ids for o in outputs]
    base = got[:len(prompts)]
    for i, name in enumerate(names[1:], start=1):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == want[name], name
        assert want[name] != base
