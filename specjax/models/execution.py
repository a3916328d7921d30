"""How a model's programs compute, resolved once: the frozen `Execution` record.

A decode config says how to run in settings, several of them "auto" (`FIELDS`: layer scan, attention,
its key block, the prefill chunk, narrow passes, the weight matmuls). `Execution.resolve` turns them
into what runs, for the platform a program is for and the model's dtype and weight format, once: the
spec holds the record (`DecodeSpec.execution`, `.draft_execution`), the loader applies it to the model's
static config (`load.with_execution`), and the model code asks that config, never a setting.

Its numerics mode (`ModelConfig.numerics`, `config.NUMERICS`) says what the outputs of one pass may
depend on: "batch_invariant" where every weight matmul runs through the CPU kernel (a row's result is
independent of how many rows are multiplied with it) and chunks of 2..INVARIANT_WIDTH positions reduce
position by position in float32 caches, so a verify pass computes bit for bit what one-token steps
compute and greedy speculative output equals greedy autoregressive output in bfloat16 too; "fast"
everywhere else (XLA's reductions, whose order depends on the shapes: equal up to float rounding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from specjax.models import matmul

SWITCH = ("auto", "on", "off")  # the settings of scan_layers and narrow_passes
ATTENTION = ("auto", "dense", "blockwise", "kernel")  # the settings of attention
FIELDS = ("scan_layers", "attention", "attention_block", "prefill_chunk", "narrow_passes", "matmul")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _switch(name: str, setting: str, auto: bool) -> bool:
  if setting not in SWITCH:
    raise ValueError(f"{name} must be one of {SWITCH}, got {setting!r}")
  return auto if setting == "auto" else setting == "on"


def _attention(setting: str, platform: str) -> str:
  """"auto": the Pallas kernel on GPU (no host read per key block), blockwise on CPU and TPU (their loops
  run on the device). "kernel" on CPU runs it in interpret mode (tests); TPU has no such kernel here."""
  if setting not in ATTENTION:
    raise ValueError(f"attention must be one of {ATTENTION}, got {setting!r}")
  if setting == "auto":
    return "kernel" if platform in _GPU_PLATFORMS else "blockwise"
  if setting == "kernel" and platform not in _GPU_PLATFORMS:
    if platform != "cpu":
      raise ValueError(f"attention='kernel' is the Pallas GPU kernel: {platform} has none here (use blockwise)")
    return "kernel_interpret"
  return setting


def resolve_dtype(
    setting: str,
    matmul_setting: str,
    weights: str = "float",
    platform: str | None = None,
) -> tuple[str, str]:
  """(the model dtype for the `dtype` setting, a phrase saying why when it was "auto"). "auto" is
  bfloat16 where it runs fast: on GPU/TPU, and on a CPU where the weight matmuls (`matmul_setting`) take
  the kernel for bfloat16; float32 elsewhere (XLA's bfloat16 matmuls on a CPU are about 10x slower)."""
  if setting != "auto":
    return setting, ""
  platform = platform or jax.default_backend()
  if platform != "cpu":
    return "bfloat16", f"dtype auto: bfloat16 on {platform}"
  try:
    fast = matmul.backend_for(matmul_setting, "bfloat16", platform, weights) == "cpu_kernel"
  except ValueError:  # matmul="cpu_kernel" that cannot run: Execution.resolve names it
    fast = False
  if fast:
    return "bfloat16", "dtype auto: bfloat16, the CPU kernel runs it"
  return "float32", (f"dtype auto: float32, {matmul.kernel_status('bfloat16', weights)[1]}"
                     if matmul_setting != "xla" else "dtype auto: float32, matmul = 'xla' on a CPU")


@dataclasses.dataclass(frozen=True)
class Execution:
  """The resolved execution settings of one model's programs (`ModelConfig` fields of the same names)."""

  scan_layers: bool  # layers stacked and run by `lax.scan` ("auto": on GPU/TPU, compile time flat in depth)
  attention: str  # `config.ATTENTION_IMPLEMENTATIONS`
  attention_block: int  # keys per block of the blockwise attention; 0 = dense
  prefill_chunk: int  # prompt tokens fed per prefill pass
  narrow_passes: bool  # a multi-width pass runs the narrowest that fits ("auto": off on GPU, a host read)
  matmul: str  # `config.MATMUL_BACKENDS` (`matmul.backend_for`)

  @classmethod
  def resolve(cls, settings: Mapping[str, Any], dtype: str, weights: str = "float",
              platform: str | None = None) -> Execution:
    """The record for `settings` (a mapping holding `FIELDS`, as a decode config does) with a model in
    `dtype` whose weights are in the format `weights`, on `platform` (None: this process's backend). A
    setting that cannot apply raises ValueError starting with its field's name."""
    platform = platform or jax.default_backend()
    for name, least, note in (("attention_block", 0, " (0 = dense)"), ("prefill_chunk", 1, "")):
      if int(settings[name]) != settings[name] or settings[name] < least:
        raise ValueError(f"{name} must be an integer >= {least}{note}, got {settings[name]}")
    return cls(scan_layers=_switch("scan_layers", settings["scan_layers"], platform
                                   != "cpu"), attention=_attention(settings["attention"], platform),
               attention_block=int(settings["attention_block"]), prefill_chunk=int(settings["prefill_chunk"]),
               narrow_passes=_switch("narrow_passes", settings["narrow_passes"], platform not in _GPU_PLATFORMS),
               matmul=matmul.backend_for(settings["matmul"], dtype, platform, weights))

  def fields(self) -> dict[str, Any]:
    """The record as `ModelConfig` fields."""
    return dataclasses.asdict(self)
