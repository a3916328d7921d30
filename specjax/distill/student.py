"""The draft's initialisations and which of its parameters train.

How a draft model starts (the objectives of `specjax.distill.objectives` pick one per `config.student.init`):
  `truncate`    the target's first `num_layers` blocks plus its embeddings, final norm and head: a draft that
                already speaks the target's language and shares its tokenizer by design;
  `fresh`       a new small `ModelConfig` of the target's architecture and vocabulary, randomly initialised;
  `check_vocab` what a loaded checkpoint must share with the target;
and which target features an EAGLE or DFlash head reads (`feature_layers`). Freezing is by parameter
subtree: embeddings, output head, chosen layers.

The student is trained, labelled and checkpointed in the per-layer layout (`layers_{i}` subtrees) even
when its config scans layers (`ModelConfig.scan_layers`, one stacked `layers` subtree): a stacked leaf
holds every layer, so it could not freeze some of them, and checkpoints do not depend on how the model
runs. Stacked params are split on the way in (`per_layer`) and restacked where the model runs
(`steps.model_params`, inside the compiled step: one copy of the student's weights per step).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from specjax.models.config import ModelConfig
from specjax.models.layout import unstack_layers
from specjax.models.transformer import Params, init_params
from specjax.speculative.drafters.eagle_head import eagle3_layers

TRAIN, FROZEN = "train", "frozen"  # labels for `optax.multi_transform`


def check_vocab(student: ModelConfig, teacher: ModelConfig, student_name: str = "student") -> None:
  if student.vocab_size != teacher.vocab_size:
    raise ValueError(f"{student_name} vocabulary ({student.vocab_size} ids) != teacher vocabulary "
                     f"({teacher.vocab_size} ids): distillation compares full next-token distributions, "
                     "so the draft needs the target's tokenizer and vocabulary")


def per_layer(params: Params) -> Params:
  """`params` in the per-layer layout: a stacked `layers` subtree split into `layers_{i}` subtrees."""
  return unstack_layers(params) if "layers" in params else params


def truncate(teacher_config: ModelConfig, teacher_params: Params, num_layers: int) -> tuple[ModelConfig, Params]:
  """The target's first `num_layers` blocks with its embeddings, final norm and head, per layer (copied
  arrays, so that donating the student's buffers never frees the teacher's); either layout of the
  target's params. Per-layer settings (Gemma's sliding / global layer types) are the kept layers'."""
  if not 1 <= num_layers <= teacher_config.n_layers:
    raise ValueError(f"student.num_layers must be in [1, {teacher_config.n_layers}] (the target's "
                     f"layers), got {num_layers}")
  kept = {
      name: tree
      for name, tree in per_layer(teacher_params).items()
      if not name.startswith("layers_") or int(name.removeprefix("layers_")) < num_layers
  }
  return teacher_config.with_depth(num_layers), jax.tree.map(jnp.copy, kept)


def fresh(teacher_config: ModelConfig, spec: ml_collections.ConfigDict, key: jax.Array) -> tuple[ModelConfig, Params]:
  """A random model of the target's architecture, vocabulary and positional settings (its layer pattern
  continued over the student's depth), sized by `spec` (per layer)."""
  config = teacher_config.with_depth(spec.n_layers).replace(
      d_model=spec.d_model, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads, head_dim=spec.head_dim, d_ff=spec.d_ff,
      tie_embeddings=spec.tie_embeddings or teacher_config.arch == "gpt2")
  return config, per_layer(init_params(config, key))


def feature_layers(spec: str, n_layers: int) -> tuple[int, ...]:
  """`student.feature_layers`: "eagle3" (EAGLE-3's low, middle and high blocks), "last" (EAGLE-1: the
  final-norm hidden state, ()) or comma-separated block indices."""
  if spec == "eagle3":
    return eagle3_layers(n_layers)
  if spec == "last":
    return ()
  try:
    return tuple(int(i) for i in spec.split(","))
  except ValueError:
    raise ValueError(f"student.feature_layers must be 'eagle3', 'last' or comma-separated block indices, "
                     f"got {spec!r}") from None


def frozen_labels(config: ModelConfig, params: Params, freeze_embeddings: bool, freeze_head: bool,
                  freeze_layers: Sequence[int]) -> Any:
  """A pytree like `params` (per-layer layout) of TRAIN / FROZEN labels. A tied head is the embedding:
  freezing either freezes both. The final norm always trains."""
  if "layers" in params:
    raise ValueError("frozen_labels needs the per-layer layout (`student.per_layer`): a stacked `layers` "
                     "leaf holds every layer, so single layers cannot be frozen in it")
  bad = [i for i in freeze_layers if not 0 <= i < config.n_layers]
  if bad:
    raise ValueError(f"student.freeze_layers {bad} out of range for a {config.n_layers}-layer student")
  frozen = {f"layers_{i}" for i in freeze_layers}
  if freeze_embeddings or (freeze_head and config.tie_embeddings):
    frozen |= {"embed", "pos_embed"} if freeze_embeddings else {"embed"}
  if freeze_head:
    frozen.add("lm_head")
  return {name: jax.tree.map(lambda _: FROZEN if name in frozen else TRAIN, tree) for name, tree in params.items()}
