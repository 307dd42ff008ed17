"""Draft-head configuration: which EAGLE head, its decoder layer's shape, and how it reads the target.

EAGLE-1/2 heads (`kind="eagle1"`) regress the target's final-norm feature and reuse the target's
LM head; EAGLE-3 heads (`kind="eagle3"`) fuse three target layers and predict tokens over a
reduced draft vocabulary of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..models.config import ModelConfig, UnsupportedConfigError

KINDS = ("eagle1", "eagle3", "oracle")


def default_target_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high capture points: the inputs of target layers 2, N//2 and N-3 (the
    vLLM / SGLang default; strictly increasing only for N >= 7, tiny test targets get e.g. (2, 1, 0))."""
    return (2, num_layers // 2, num_layers - 3)


def check_target_layers(layers, what: str = "EAGLE-3 target_layers") -> tuple[int, ...]:
    """`layers` as a tuple of ints, refused unless strictly increasing: vLLM and SGLang capture the
    aux hidden states while walking the target's layers, so fc's input columns are always in
    ascending layer order (a permuted or repeated id would feed fc the wrong features)."""
    layers = tuple(int(i) for i in layers)
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise UnsupportedConfigError(
            f"{what} {layers} must be strictly increasing: vLLM and SGLang append the captured hidden states "
            f"in ascending layer order, so fc's input columns follow that order (use {tuple(sorted(set(layers)))} "
            f"and train the head for it)")
    return layers


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A draft head.

    layer: shape of the head's single decoder layer (hidden size, heads, RoPE, eps, dtype). Its
      `vocab_size` is the target's vocabulary.
    fc_bias: EAGLE-1's fc(2d→d) has a bias in the released heads; EAGLE-3's fc(3d→d) has none.
    draft_vocab_size: EAGLE-3 only; the head predicts over this many of the target's tokens.
    target_layers: EAGLE-3 only; HF hidden_states indices fused by fc (inputs of those layers), in
      fc's column order. Explicit ones (`for_target`, a checkpoint's config.json, `load_drafter`'s
      override) must be strictly increasing (`check_target_layers`); only the default of a tiny
      target (N < 7) may not be, and `save_drafter` warns that servers cannot run such a head.
    target_hidden_size: the target's hidden size (EAGLE-3 fc input is 3× this).
    """

    kind: str  # "oracle": the target drafting for itself (maximal acceptance; tests, upper bounds)
    layer: ModelConfig
    fc_bias: bool = True
    draft_vocab_size: Optional[int] = None
    target_layers: tuple[int, ...] = ()
    target_hidden_size: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UnsupportedConfigError(f"draft kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "eagle3":
            if not self.target_layers:
                raise UnsupportedConfigError("an EAGLE-3 head needs target_layers (the fused target layers)")
            if self.draft_vocab_size is None or not 0 < self.draft_vocab_size <= self.layer.vocab_size:
                raise UnsupportedConfigError(
                    f"draft_vocab_size must be in [1, {self.layer.vocab_size}], got {self.draft_vocab_size}")
        elif self.kind == "oracle" and self.draft_vocab_size not in (None,) and not (
                0 < self.draft_vocab_size <= self.layer.vocab_size):
            raise UnsupportedConfigError(f"draft_vocab_size out of range: {self.draft_vocab_size}")
        elif self.kind == "eagle1" and self.target_hidden_size not in (None, self.layer.hidden_size):
            raise UnsupportedConfigError("an EAGLE-1 head must have the target's hidden size")

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def out_vocab_size(self) -> int:
        """Width of the head's logits: the draft vocabulary (EAGLE-3) or the target's (EAGLE-1)."""
        return self.draft_vocab_size or self.layer.vocab_size if self.kind != "eagle1" else self.layer.vocab_size

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head consumes at its first step."""
        t = self.target_hidden_size or self.layer.hidden_size
        return t * len(self.target_layers) if self.kind == "eagle3" else t

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    def replace(self, **changes) -> "DraftConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_target(cls, kind: str, target: ModelConfig, *, draft_vocab_size: Optional[int] = None,
                   target_layers: Optional[tuple[int, ...]] = None, intermediate_size: Optional[int] = None,
                   fc_bias: Optional[bool] = None) -> "DraftConfig":
        """A head shaped like one layer of `target` (the usual choice for both EAGLE kinds)."""
        layer = target.replace(num_layers=1, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                               sliding_window=None, family="llama",
                               intermediate_size=intermediate_size or target.intermediate_size)
        if kind == "eagle3":
            layers = check_target_layers(target_layers) if target_layers else default_target_layers(target.num_layers)
            return cls("eagle3", layer, fc_bias=bool(fc_bias), draft_vocab_size=draft_vocab_size or target.vocab_size,
                       target_layers=layers,
                       target_hidden_size=target.hidden_size)
        return cls("eagle1", layer, fc_bias=True if fc_bias is None else fc_bias)
