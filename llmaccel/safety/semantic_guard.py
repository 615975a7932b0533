"""The semantic input guard's classifier: logistic regression on the served model's own hidden states,
pooled over the prompt (safety/guard_train.py trains it, engine/guard_stage.py runs it in the engine).

Word lists do not carry over from one family of jailbreak templates to the next; the model's hidden
states do, better (docs/safety.md). The features are the residual stream after a few layers, averaged
over every prompt token (and, with pooling "mean+last", the last prompt token's stream beside it),
standardized, then one dot product: a verdict costs microseconds once the prefill has run.

A classifier file is safetensors: float32 tensors `mean`, `scale`, `weight` (one value per feature),
`bias` and `probe` (the features of PROBE_TEXT when it was trained), and metadata naming the format,
the model it was trained on, its shape, the layers, the pooling, the threshold and the training sets.
At load the served model computes the probe's features again: hidden states of another model (or a
different fine-tune of the same shape) are caught by their cosine, not only by their shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from llmaccel.errors import LLMAccelError

GUARD_FORMAT = "llmaccel-semantic-guard/1"
POOLINGS = ("mean", "mean+last")
PROBE_TEXT = ("Please summarize the following paragraph in two sentences: The committee met on Tuesday to "
              "review the budget, and after a long discussion it agreed to fund the new library.")
PROBE_MIN_COSINE = 0.95  # INT8 and INT4 variants of the trained model measure >= 0.99 (tests/test_semantic_guard.py)
SHIPPED_GUARDS = {"smollm2-135m": "guards/smollm2-135m.safetensors"}
_TENSORS = ("mean", "scale", "weight", "bias", "probe")


class GuardFileError(LLMAccelError):
    """A semantic-guard classifier file that cannot be used: unreadable, or trained on another model."""


@dataclass(frozen=True)
class GuardClassifier:
    model: str  # the model it was trained on, as named to train-guard
    architecture: str
    hidden_size: int
    num_layers: int
    layers: tuple[int, ...]  # 0-based layers whose output stream is pooled
    pooling: str  # "mean" or "mean+last"
    mean: torch.Tensor  # [features] float32: standardization
    scale: torch.Tensor
    weight: torch.Tensor
    bias: float
    threshold: float  # a probability: at or above it the prompt is judged an attack
    probe: torch.Tensor  # the features of PROBE_TEXT on the trained model
    sources: tuple[str, ...] = ()  # the labelled sets it was trained on

    @property
    def num_features(self) -> int:
        return len(self.layers) * self.hidden_size * (2 if self.pooling == "mean+last" else 1)

    def features(self, mean: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The classifier's input from the pooled stream ([..., layers * hidden] each)."""
        return torch.cat([mean, last], dim=-1) if self.pooling == "mean+last" else mean

    def score(self, features: torch.Tensor) -> torch.Tensor:
        """The probability that each row of `features` ([..., num_features]) is an attack."""
        standardized = (features.float() - self.mean) / self.scale
        return torch.sigmoid(standardized @ self.weight + self.bias)

    def save(self, path: Path, extra: dict[str, object] | None = None) -> None:
        """Write the classifier; `extra`: more metadata (the held-out figures it was chosen by)."""
        metadata = {"format": GUARD_FORMAT, "model": self.model, "architecture": self.architecture,
                    "hidden_size": str(self.hidden_size), "num_layers": str(self.num_layers),
                    "layers": json.dumps(list(self.layers)), "pooling": self.pooling,
                    "threshold": repr(self.threshold), "sources": json.dumps(list(self.sources)),
                    **{k: json.dumps(v) for k, v in (extra or {}).items()}}
        tensors = {"mean": self.mean, "scale": self.scale, "weight": self.weight,
                   "bias": torch.tensor([self.bias]), "probe": self.probe}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: Path) -> GuardClassifier:
        """Read a classifier file; any fault is a GuardFileError that names the file and the fault."""
        if not path.is_file():
            raise GuardFileError(f"semantic guard file {path} does not exist")
        try:
            tensors = load_file(str(path))
            from safetensors import safe_open

            with safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
        except (SafetensorError, OSError, ValueError) as exc:
            raise GuardFileError(f"semantic guard file {path} is not a readable safetensors file ({exc})") from None
        if metadata.get("format") != GUARD_FORMAT:
            raise GuardFileError(f"semantic guard file {path} is not a classifier of format {GUARD_FORMAT} "
                                 f"(its format: {metadata.get('format')!r})")
        missing = [name for name in _TENSORS if name not in tensors]
        if missing:
            raise GuardFileError(f"semantic guard file {path} has no tensor {missing[0]!r}")
        try:
            guard = cls(model=metadata["model"], architecture=metadata["architecture"],
                        hidden_size=int(metadata["hidden_size"]), num_layers=int(metadata["num_layers"]),
                        layers=tuple(int(i) for i in json.loads(metadata["layers"])), pooling=metadata["pooling"],
                        mean=tensors["mean"], scale=tensors["scale"], weight=tensors["weight"],
                        bias=float(tensors["bias"][0]), threshold=float(metadata["threshold"]),
                        probe=tensors["probe"], sources=tuple(json.loads(metadata.get("sources", "[]"))))
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            raise GuardFileError(f"semantic guard file {path} has bad metadata ({type(exc).__name__}: {exc})") from None
        if guard.pooling not in POOLINGS:
            raise GuardFileError(f"semantic guard file {path} has pooling {guard.pooling!r}; expected one of "
                                 f"{', '.join(POOLINGS)}")
        for name in ("mean", "scale", "weight", "probe"):
            if tuple(tensors[name].shape) != (guard.num_features,):
                raise GuardFileError(f"semantic guard file {path}: tensor {name!r} has shape "
                                     f"{tuple(tensors[name].shape)}, but {len(guard.layers)} layers x "
                                     f"{guard.hidden_size} ({guard.pooling}) make {guard.num_features} features")
        if not all(torch.isfinite(tensors[n]).all() for n in _TENSORS) or (guard.scale <= 0).any():
            raise GuardFileError(f"semantic guard file {path} holds non-finite values or a scale <= 0")
        if not 0.0 < guard.threshold < 1.0:
            raise GuardFileError(f"semantic guard file {path} has threshold {guard.threshold}; it must be in (0, 1)")
        return guard

    def check_model(self, path: Path, model: str, architecture: str, hidden_size: int, num_layers: int) -> None:
        """Raise GuardFileError unless the served model has the shape this classifier was trained on."""
        if (architecture, hidden_size, num_layers) != (self.architecture, self.hidden_size, self.num_layers) \
                or self.layers[-1] >= num_layers:
            raise GuardFileError(
                f"semantic guard file {path} was trained on {self.model} ({self.architecture}, {self.num_layers} "
                f"layers of {self.hidden_size}); this server runs {model} ({architecture}, {num_layers} layers of "
                f"{hidden_size}). Train one for it: llmaccel safety train-guard --model {model}")

    def check_probe(self, path: Path, model: str, probe: torch.Tensor) -> float:
        """The cosine of the served model's probe features to the trained ones; GuardFileError below
        PROBE_MIN_COSINE (hidden states of another model of the same shape)."""
        cosine = float(torch.nn.functional.cosine_similarity(probe.float(), self.probe, dim=0))
        if cosine < PROBE_MIN_COSINE:
            raise GuardFileError(
                f"semantic guard file {path} was trained on {self.model}, whose hidden states differ from those "
                f"of {model} (probe cosine {cosine:.3f} < {PROBE_MIN_COSINE}). Train one for it: "
                f"llmaccel safety train-guard --model {model}")
        return cosine


def render_prompt(tokenizer, text: str) -> list[int]:
    """The token ids the server's chat route gives the engine for one user message."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=True)


def probe_features(scorer, tokenizer, layers: tuple[int, ...], pooling: str) -> torch.Tensor:
    """The features of PROBE_TEXT on a model (a SequenceScorer's pass, engine/scoring.py)."""
    mean, last = scorer.pooled_states(render_prompt(tokenizer, PROBE_TEXT), layers)
    return torch.cat([mean, last]) if pooling == "mean+last" else mean


def trained_guard_path(model: str, cache_dir: Path | None = None) -> Path:
    """Where `llmaccel safety train-guard --model M` writes M's classifier by default."""
    from llmaccel.config import default_cache_dir

    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model.strip("/")).strip("_")
    return (cache_dir or default_cache_dir()) / "guards" / f"{slug}.safetensors"


def resolve_guard(name: str, model: str) -> Path | None:
    """The classifier file `--semantic-guard NAME` means for `model`: a path as given, or for "default" the
    one shipped for it, else the one train-guard wrote for it; None when "default" finds neither."""
    if name != "default":
        return Path(name)
    shipped = SHIPPED_GUARDS.get(model)
    if shipped is not None:
        return Path(str(files("llmaccel.safety") / shipped))
    trained = trained_guard_path(model)
    return trained if trained.is_file() else None
