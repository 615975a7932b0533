"""The student: the teacher's tokenizer, embedding, width, final norm and LM head, and a subset of its
decoder layers, copied as they are, so training starts from a model that already reads the text.

Which layers: `spaced` keeps every k-th layer, the first and last always (as DistilBERT took every
second layer of BERT); `influence` keeps the layers that change the hidden state most on the corpus
(ShortGPT's block influence, 1 - cos(input, output) of each layer, averaged over tokens): a layer
whose output is nearly its input is the cheapest to drop; `copy` keeps the first and last layers and
the teacher's copying circuit, and fills the rest by influence. A draft for speculative decoding must
continue what the context repeats, which a transformer does with an induction head (attending to the
token after the last occurrence of the current one) reading what a previous-token head wrote (Olsson et
al. 2022). Both are measured on a random token sequence shown twice: the layer whose head attends most
from each token of the second copy to the token after its first occurrence, and before it the layer
whose head attends most to the token just before. Small students chosen by influence alone dropped that
circuit and could not copy a repeated sentence (docs/distillation.md).
"""

from __future__ import annotations

import copy

import torch

LAYER_CHOICES = ("spaced", "influence", "copy")


def check_layer_count(keep: int, teacher_layers: int) -> None:
    if not 1 <= keep <= teacher_layers:
        raise ValueError(f"--student-layers {keep}: the teacher has {teacher_layers} layers; keep 1 to "
                         f"{teacher_layers}")


def spaced_layers(teacher_layers: int, keep: int) -> list[int]:
    """`keep` layer indices spread evenly over the teacher's, the first and the last included."""
    check_layer_count(keep, teacher_layers)
    if keep == 1:
        return [teacher_layers - 1]
    return sorted({round(i * (teacher_layers - 1) / (keep - 1)) for i in range(keep)})


@torch.no_grad()
def block_influence(teacher, windows: torch.Tensor) -> list[float]:
    """Each decoder layer's mean 1 - cos(its input, its output) over the tokens of `windows` [B, T]
    (read with hooks on the layers themselves, whatever the model's hidden-state outputs include)."""
    layers = teacher.model.layers
    scores = [0.0] * len(layers)

    def recorder(index: int):
        def hook(module, args, kwargs, output):
            before = (args[0] if args else kwargs["hidden_states"]).float()
            after = (output[0] if isinstance(output, tuple) else output).float()
            scores[index] = 1.0 - torch.nn.functional.cosine_similarity(before, after, dim=-1).mean().item()
        return hook

    handles = [layer.register_forward_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        teacher(windows)
    finally:
        for handle in handles:
            handle.remove()
    return scores


def influential_layers(teacher, windows: torch.Tensor, keep: int) -> tuple[list[int], list[float]]:
    """The `keep` layers of highest block influence on `windows` (in model order), and every layer's score."""
    scores = block_influence(teacher, windows)
    check_layer_count(keep, len(scores))
    chosen = sorted(sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:keep])
    return chosen, scores


@torch.no_grad()
def attention_pattern_scores(teacher, length: int = 48, rows: int = 4,
                             seed: int = 0) -> tuple[list[float], list[float]]:
    """Per layer, its strongest head's mean (induction score, previous-token score) on `rows` random token
    sequences of `length`, each shown twice: the attention from each token of the second copy to the token
    after its first occurrence, and from each token to the one before it."""
    vocab = teacher.config.vocab_size
    ids = torch.randint(min(1000, vocab // 4), min(20000, vocab), (rows, length),
                        generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([ids, ids], dim=1)
    was = teacher.config._attn_implementation
    teacher.set_attn_implementation("eager")  # the fused kernels do not return the attention weights
    try:
        attentions = teacher(ids, output_attentions=True).attentions  # per layer [rows, heads, T, T]
    finally:
        teacher.set_attn_implementation(was)
    second = torch.arange(length, 2 * length)
    later = torch.arange(1, 2 * length)
    induction = [a[:, :, second, second - length + 1].mean(dim=(0, 2)).max().item() for a in attentions]
    previous = [a[:, :, later, later - 1].mean(dim=(0, 2)).max().item() for a in attentions]
    return induction, previous


def copying_layers(teacher, windows: torch.Tensor, keep: int) -> tuple[list[int], list[float], dict]:
    """`keep` layers by `choose_copying_layers`, with every layer's block influence and attention scores."""
    scores = block_influence(teacher, windows)
    check_layer_count(keep, len(scores))
    induction, previous = attention_pattern_scores(teacher)
    chosen = choose_copying_layers(induction, previous, scores, keep)
    return chosen, scores, {"induction": induction, "previous_token": previous}


def choose_copying_layers(induction: list[float], previous: list[float], influence: list[float],
                          keep: int) -> list[int]:
    """The strongest induction layer (past the first), the strongest previous-token layer before it, the
    first and the last layer, in that order of priority; then the rest by block influence. In model order."""
    last = len(influence) - 1
    inducer = max(range(1, last + 1), key=lambda i: induction[i]) if last else 0
    before = max(range(inducer), key=lambda i: previous[i]) if inducer else 0
    chosen = list(dict.fromkeys([inducer, before, 0, last]))[:keep]
    for index in sorted(range(len(influence)), key=lambda i: influence[i], reverse=True):
        if len(chosen) == keep:
            break
        if index not in chosen:
            chosen.append(index)
    return sorted(chosen)


def make_student(teacher, layers: list[int]):
    """A model of the teacher's class and config with only `layers` (teacher indices, in order), every
    kept tensor copied from the teacher: with every layer kept it computes exactly what the teacher does."""
    total = teacher.config.num_hidden_layers
    if not layers or sorted(set(layers)) != list(layers) or layers[0] < 0 or layers[-1] >= total:
        raise ValueError(f"student layers {layers}: give distinct teacher layer indices in order, in 0..{total - 1}")
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    student = type(teacher)(config)
    source = teacher.state_dict()
    target = {}
    for name in student.state_dict():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = str(layers[int(parts[2])])
        target[name] = source[".".join(parts)].detach().clone()
    student.load_state_dict(target, strict=True)
    if getattr(config, "tie_word_embeddings", False):
        student.tie_weights()
    return student.to(next(teacher.parameters()).dtype)
