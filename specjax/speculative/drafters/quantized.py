"""The quantized drafter: the target drafts for itself through its own weights re-quantized (int4 per
group by default, or int8 per channel), as ML-SpecQD casts a bfloat16 target to MXFP4. No second model,
no training, one tokenizer; the draft's KV cache is its own (its keys and values are the quantized
model's, not the target's).

It is the model drafter (`model.ModelDrafter`: the lag, catch-up, early stop, restricted head and trees
all apply) whose draft model is `quantized.quantize_params` of the target's params, built from the
loaded target instead of a loaded `config.draft`. The draft's weight matmuls run on the target's backend:
through the CPU kernel, which unpacks the codes in registers, where the target's run there (`matmul =
"auto"` sends a bfloat16 target through it on a vectorised CPU), else on XLA.

One trap when reading its numbers: the default target's float weights were themselves dequantized from
Q4_K blocks. A fresh int4 quantization of them (this drafter) is a real 4-bit draft; a draft that kept
the file's own blocks would differ from the target by rounding only and would show the engine's
ceiling, not what a quantized draft gives (docs/quantized-drafts.md).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, ClassVar

import ml_collections

from specjax.errors import ConfigError
from specjax.models import quantized
from specjax.speculative.drafters.base import DrafterSettings
from specjax.speculative.drafters.draft_head import add_vocab_options, check_vocab_options
from specjax.speculative.drafters.model import ModelDrafter, _settings_error

if TYPE_CHECKING:
  from specjax.models.load import LoadedModel


def check_weights(settings: DrafterSettings) -> None:
  """Raises `ConfigError` naming `config.<group>.weights` unless it is a weight format."""
  try:
    quantized.parse(settings.options.weights)
  except quantized.FormatError as error:
    raise ConfigError(f"{settings.field('weights')}: {error}") from None


class QuantizedDrafter(ModelDrafter):
  """A model drafter whose draft is the target's own weights in `config.quantized.weights`."""

  name: ClassVar[str] = "quantized"
  loads_draft_model: ClassVar[bool] = False

  @classmethod
  def config_group(cls) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    group.weights = "int4"  # the draft's weight format: "int4" (groups of 32), "int4:G" (G in 32..128,
    #                         dividing the target's widths), "int8" (per output channel) or "float" (the
    #                         target itself: every token accepted, a ceiling); see docs/quantized-drafts.md
    add_vocab_options(group)
    group.stop_threshold = 0.0  # a row stops drafting when the draft's top probability falls below this
    #                             (0 = off; in [0, 1)), as config.model.stop_threshold
    return group

  @classmethod
  def check_config(cls, settings: DrafterSettings) -> None:
    options = settings.options
    check_weights(settings)
    check_vocab_options(options, settings.group)
    error = _settings_error(options.stop_threshold, settings.tree, settings.tree_children)
    if error:
      raise ConfigError(f"config.{settings.group + '.' if error.startswith('stop') else ''}{error}")

  @classmethod
  def build(cls, settings: DrafterSettings, target: LoadedModel, draft: LoadedModel | None,
            log: Callable[[str], None] = print) -> tuple[QuantizedDrafter, dict]:
    fmt = quantized.parse(settings.options.weights)
    if target.part is not None and fmt is not None:
      raise ConfigError(f"{settings.field('weights')}: quantized weights on a mesh are not supported yet")
    try:
      params = quantized.quantize_params(target.config, target.params, fmt)
    except quantized.FormatError as error:
      raise ConfigError(f"{settings.field('weights')}: {error}") from None
    log(f"quantized draft: the target's weights as {settings.options.weights}")
    own = dataclasses.replace(target, name=f"{target.name} ({settings.options.weights})", params=params)
    drafter, facts = super().build(settings, target, own, log)
    return drafter, {**facts, "draft_weights": quantized.describe(params)}
