"""bfloat16 weights in 12 bits a weight (ops/csrc/bf16_compact.cpp): every weight decodes to its own bits, the
blocks holding a high byte outside the 16 codes are kept whole (exactly those, at exactly the sizes the layout
gives), and the streaming kernel and the GEMM on it give the plain layout's kernels' results to the bit."""

from __future__ import annotations

import pytest
import torch

from llmaccel import LLM, SamplingParams
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.kernel_choice import (
    COMPACT_TOLERANCE,
    FORCE_ENV,
    LAYOUT_ENV,
    candidates,
    compact_available,
    pack_compact,
    pick_layout,
    tune_bf16,
)

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "pack_bf16_compact"),
                                reason="C++ kernels unavailable on this machine")
needs_kernels = pytest.mark.skipif("compact_stream" not in candidates(),
                                   reason="the compact kernels need AVX512-BF16")


def _align64(n: int) -> int:
    return -(-n // 64) * 64


def _size(n: int, k: int, whole: int) -> int:
    """The layout's bytes: a 128-byte header, the blocks, the bitmap, the index, the whole blocks."""
    blocks = _align64(128 + n * (k // 64) * 96)
    bitmap = _align64(n * -(-(k // 64) // 64) * 8)
    return blocks + bitmap + _align64((n + 1) * 8) + whole * 128


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=generator) * 0.02).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_every_weight_decodes_to_its_own_bits_and_only_uncoded_blocks_are_kept_whole():
    frequent = [0x3C + i for i in range(8)] + [0xBC + i for i in range(8)]  # 16 high bytes, each 40 times
    high = torch.tensor(frequent * 40, dtype=torch.int32).view(5, 128)
    high[1, 70], high[3, 0], high[3, 5] = 0x7F, 0xFF, 0x01  # rare ones: in row 1's second block, row 3's first
    low = torch.randint(0, 256, (5, 128), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    w = (high * 256 + low).to(torch.int16).view(torch.bfloat16)  # (NaN, inf and subnormal bits among them)
    packed = kernels.pack_bf16_compact(w)
    assert packed.numel() == _size(5, 128, whole=2)
    assert torch.equal(_bits(kernels.unpack_bf16_compact(packed)), _bits(w))
    ids = torch.tensor([[3, 1, 3], [0, 4, 2]])
    assert torch.equal(_bits(kernels.unpack_bf16_compact(packed, ids)), _bits(w[ids]))


def test_a_typical_weight_takes_three_quarters_of_its_bytes():
    w = _weights(256, 2048)
    packed = kernels.pack_bf16_compact(w)  # every build packs; only AVX512-BF16 ones compute on the layout
    assert packed.numel() < 0.77 * w.numel() * 2
    assert torch.equal(_bits(kernels.unpack_bf16_compact(packed)), _bits(w))
    if compact_available():  # where the compact kernels run, the engine takes this layout for such a weight
        assert torch.equal(pack_compact(w), packed)
    else:
        assert pack_compact(w) is None


def test_a_weight_whose_high_bytes_spread_wide_is_left_plain():
    noise = torch.randint(-2**15, 2**15, (64, 256), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert pack_compact(noise) is None  # most blocks would be whole: no saving
    assert pack_compact(_weights(64, 96)) is None  # K not a multiple of 64


def test_bad_input_is_named():
    with pytest.raises(RuntimeError, match="the compact layout needs K a multiple of 64, got 96"):
        kernels.pack_bf16_compact(_weights(4, 96))
    with pytest.raises(RuntimeError, match="not a compact bf16 weight"):
        kernels.unpack_bf16_compact(torch.zeros(4096, dtype=torch.uint8))
    packed = kernels.pack_bf16_compact(_weights(8, 64))
    with pytest.raises(RuntimeError, match="row 8 is outside the weight's 8 rows"):
        kernels.unpack_bf16_compact(packed, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="header does not match its size"):
        kernels.unpack_bf16_compact(packed[:-64].clone())


@needs_kernels
# 9-13: a dot group of 8 rows and the rest; 100, 130 at K = 2,048: chunks of 64 rows, each pass of columns decoded
# once for all of them
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 13, 17, 40, 64, 100, 130])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (300, 576), (64, 2048)])
def test_the_kernels_give_the_plain_kernels_results_to_the_bit(rows, n, k):
    w = _weights(n, k, seed=rows + n)
    w[n // 2, k - 3] = 1e30  # a whole block in the middle of a row
    w[0, 1] = -1e-35
    packed = kernels.pack_bf16_compact(w)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    assert torch.equal(kernels.linear_bf16_compact(x, packed, False), kernels.gemv_bf16(x, w))
    assert torch.equal(_bits(kernels.linear_bf16_compact(x, packed, True)), _bits(kernels.gemm_bf16(x, w)))


@needs_kernels
def test_the_kernels_name_what_they_cannot_take():
    packed = kernels.pack_bf16_compact(_weights(8, 128))
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \[rows, 128\]"):
        kernels.linear_bf16_compact(torch.zeros(2, 128), packed, False)
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \[rows, 128\]"):
        kernels.linear_bf16_compact(torch.zeros(2, 64, dtype=torch.bfloat16), packed, True)


def test_the_compact_layout_is_taken_within_its_tolerance_of_the_fastest():
    plain = [1.0, 2.0, 4.0]
    slower = 1 + COMPACT_TOLERANCE * 0.9
    assert pick_layout({"plain": plain, "vnni": [], "compact": [t * slower for t in plain]}, 3) == "compact"
    slower = 1 + COMPACT_TOLERANCE * 1.1
    assert pick_layout({"plain": plain, "vnni": [], "compact": [t * slower for t in plain]}, 3) == "plain"
    # faster at one row, slower at many: the geometric mean decides
    assert pick_layout({"plain": plain, "compact": [0.5, 2.2, 4.4]}, 3) == "compact"
    assert pick_layout({"plain": plain, "vnni": [0.97, 1.94, 3.88], "compact": [1.0, 2.0, 4.0]}, 3) == "compact"
    assert pick_layout({"plain": plain, "vnni": [0.5, 1.0, 2.0], "compact": [1.0, 2.0, 4.0]}, 3) == "vnni"
    assert pick_layout({"plain": plain, "compact": [0.5]}, 3) == "plain"  # not timed at every bucket


@needs_kernels
def test_a_model_in_the_compact_layout_generates_the_plain_layouts_tokens(tiny_model_dirs, monkeypatch):
    """The tied table's rows are read from the compact layout too (the embedding lookup)."""
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = {}
    for kernel in ("stream", "compact_stream", "gemm", "compact_gemm"):
        monkeypatch.setenv(FORCE_ENV, kernel)
        llm = LLM(str(tiny_model_dirs["llama-tied"]), dtype="bfloat16")
        head = llm.engine.runner.model.lm_head
        assert (head.compact is not None) == kernel.startswith("compact")
        outputs[kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["compact_stream"] == outputs["stream"]
    assert outputs["compact_gemm"] == outputs["gemm"]


def test_the_layout_benchmark_times_a_layers_fused_projections():
    from llmaccel.bench.bf16_layouts import measure, projections
    from llmaccel.model.shapes import ModelShape, shape_named

    assert projections(shape_named("llama-1b")) == {"qkv": (3072, 2048), "o": (2048, 2048),
                                                    "gate_up": (16384, 2048), "down": (2048, 8192)}
    if "compact_stream" not in candidates():
        pytest.skip("the compact kernels need AVX512-BF16")
    tiny = ModelShape("tiny", "LlamaForCausalLM", 512, 1024, 1, 8, 2, 64, True, 1e4, "test")
    results = measure(tiny, rows=[1, 3], rounds=1, budget=1e5)
    assert [(r["projection"], r["rows"], r["plain_kernel"]) for r in results] == [
        (name, rows, kernel) for name in ("qkv", "o", "gate_up", "down") for rows in (1, 3)
        for kernel in ("stream", "gemm")]
    assert all(0.75 < r["compact_bytes_share"] < 0.8 and r["speedup"] > 0 for r in results)


@needs_kernels
def test_a_layout_can_be_asked_for_and_is_still_timed_per_row_count(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(FORCE_ENV, raising=False)
    weights = [_weights(64, 128, seed=1), _weights(128, 64, seed=2)]
    for layout in ("compact", "plain"):
        monkeypatch.setenv(LAYOUT_ENV, layout)
        layers, head = tune_bf16(weights, _weights(96, 64, seed=3))
        assert layers.layout == head.layout == layout
    monkeypatch.setenv(LAYOUT_ENV, "tiles")
    with pytest.raises(ValueError, match=r"\$LLMACCEL_BF16_LAYOUT='tiles' is not a bf16 layout this machine has "
                                         r"kernels for: compact, plain(, vnni)?"):
        tune_bf16(weights, None)


@needs_kernels
def test_the_layout_flag_is_taken_over_the_environment_and_names_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.setenv(LAYOUT_ENV, "plain")
    weights = [_weights(64, 128, seed=1), _weights(128, 64, seed=2)]
    layers, head = tune_bf16(weights, _weights(96, 64, seed=3), layout="compact")
    assert layers.layout == head.layout == "compact"
    with pytest.raises(ValueError, match=r"--bf16-layout tiles is not a bf16 layout this machine has kernels for"):
        tune_bf16(weights, None, layout="tiles")


def test_bad_layout_settings_are_named():
    from llmaccel.config import ModelConfig

    with pytest.raises(ValueError, match="unknown bf16 layout 'tiles'; choose one of auto, plain, vnni, compact"):
        ModelConfig(bf16_layout="tiles")
    with pytest.raises(ValueError, match="--batch-invariant runs the vnni layout's ordered kernels; --bf16-layout "
                                         "compact has none"):
        ModelConfig(bf16_layout="compact", batch_invariant=True)


@needs_kernels
def test_a_server_asked_for_the_compact_layout_holds_every_bf16_weight_in_it(tiny_model_dirs, tmp_path, monkeypatch):
    """--bf16-layout compact: every projection and the tied head in 12 bits (the kernels' bits against the plain
    layout's: test_a_model_in_the_compact_layout_generates_the_plain_layouts_tokens)."""
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(FORCE_ENV, raising=False)
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for layout in ("plain", "compact"):
        llm = LLM(str(tiny_model_dirs["llama-tied"]), dtype="bfloat16", bf16_layout=layout)
        model = llm.engine.runner.model
        modules = [*model.layers[0].projections, model.lm_head]
        assert all((m.compact is not None) == (layout == "compact") for m in modules)
        assert len(llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids) == 16
