"""Activation-aware weight quantization (AWQ, Lin et al. 2023): per-input-channel scales, for INT4
(its home) and INT8 (where one scale per row must also span channels of very different weight).

For a layer y = x W^T, multiplying W's input channel k by s_k and dividing x_k by s_k changes
nothing in float, but the quantizer then spends more of each group's grid on the channels that carry
large activations. As in the reference implementation (mit-han-lab/llm-awq, `auto_scale`), s is
mean|x|^alpha (normalised), with alpha searched on a grid of 20 to minimise the error of the
quantized layer's output on calibration activations; alpha = 0 is plain round-to-nearest, so the
search never does worse than RTN on its own objective.

The division by s folds into the op that feeds the layer, so the model runs unchanged:
- q/k/v and gate/up: into the RMSNorm weight before them;
- down: into the up projection's rows (down's input is silu(gate) * up);
- o: into v's rows, only where every query head has its own v head (with GQA several query heads
  share one v row, so one scale per channel cannot fold; the reference code skips it too).
"""

from __future__ import annotations

import torch

from llmaccel.quantization.formats import quantize

GRID = 20
ROWS_KEPT = 4096  # calibration rows per layer that the error is measured on


class ActivationRecorder:
    """Mean |x| per input channel over every calibration token, and a random sample of rows."""

    def __init__(self, rows_per_call: int, generator: torch.Generator) -> None:
        self.rows_per_call, self.generator = rows_per_call, generator
        self.abs_sum: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        x = args[0].detach().float()
        self.abs_sum = x.abs().sum(0) if self.abs_sum is None else self.abs_sum + x.abs().sum(0)
        self.count += x.shape[0]
        pick = torch.randperm(x.shape[0], generator=self.generator)[: self.rows_per_call]
        self.rows.append(x[pick].clone())

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.count

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)[:ROWS_KEPT]


def record_activations(llm, samples: list[list[int]], progress: bool = True) -> dict[str, ActivationRecorder]:
    """Run the float model over the calibration samples, recording each decoder layer's inputs.
    Keys: `<i>.qkv`, `<i>.o`, `<i>.gate_up`, `<i>.down`."""
    from tqdm.auto import tqdm

    generator = torch.Generator().manual_seed(0)
    rows_per_call = max(1, -(-ROWS_KEPT // len(samples)))
    recorders, handles = {}, []
    for i, layer in enumerate(llm.engine.runner.model.layers):
        for name, module in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.mlp.gate_up),
                             ("down", layer.mlp.down)):
            recorders[f"{i}.{name}"] = recorder = ActivationRecorder(rows_per_call, generator)
            handles.append(module.register_forward_pre_hook(recorder))
    try:
        for ids in tqdm(samples, desc="calibrating", unit="sample", disable=not progress):
            llm.engine.score(ids)
    finally:
        for handle in handles:
            handle.remove()
    return recorders


def search_scale(x: torch.Tensor, mean_abs: torch.Tensor, weight: torch.Tensor, method: str,
                 group_size: int | None) -> tuple[torch.Tensor, float]:
    """The per-input-channel scale (and its alpha) that minimises ||x W^T - (x / s) Q(W s)^T||^2."""
    reference = x @ weight.t()
    best_error, best_scale, best_alpha = float("inf"), torch.ones_like(mean_abs), 0.0
    for step in range(GRID):
        alpha = step / GRID
        scale = mean_abs.pow(alpha).clamp(min=1e-4)
        scale = scale / (scale.max() * scale.min()).sqrt()
        dequantized = quantize(weight * scale, method, group_size).dequantize() / scale
        error = (x @ dequantized.t() - reference).pow(2).mean().item()
        if error < best_error:
            best_error, best_scale, best_alpha = error, scale, alpha
    return best_scale, best_alpha


def apply_awq(weights: dict[str, torch.Tensor], recorders: dict[str, ActivationRecorder], num_layers: int,
              num_heads: int, num_kv_heads: int, method: str, group_size: int | None) -> dict[str, float]:
    """Search and fold the scales into `weights` (float, HF names) in place; returns alpha per layer."""
    alphas = {}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        plans = [  # (recorder, scaled layers, op whose output is divided by the scale)
            ("qkv", [attn + "q_proj", attn + "k_proj", attn + "v_proj"], p + "input_layernorm.weight"),
            ("gate_up", [mlp + "gate_proj", mlp + "up_proj"], p + "post_attention_layernorm.weight"),
            ("down", [mlp + "down_proj"], mlp + "up_proj.weight"),
        ]
        if num_heads == num_kv_heads:
            plans.append(("o", [attn + "o_proj"], attn + "v_proj.weight"))
        for key, layers, previous in plans:
            recorder = recorders[f"{i}.{key}"]
            fused = torch.cat([weights[name + ".weight"] for name in layers])
            scale, alphas[p + key] = search_scale(recorder.sample, recorder.mean_abs, fused, method, group_size)
            for name in layers:
                weights[name + ".weight"] = weights[name + ".weight"] * scale
            _divide_output(weights, previous, scale)
    return alphas


def _divide_output(weights: dict[str, torch.Tensor], name: str, scale: torch.Tensor) -> None:
    """Divide the output channels of the op `name` (a norm weight [K] or a linear weight [K, in]) by scale."""
    tensor = weights[name]
    weights[name] = tensor / scale if tensor.dim() == 1 else tensor / scale[:, None]
    bias = name.removesuffix(".weight") + ".bias"
    if tensor.dim() == 2 and bias in weights:
        weights[bias] = weights[bias] / scale
