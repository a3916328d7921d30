"""What a decode program does on a platform, read from its lowering for that platform: no device needed,
nothing runs (`python -m specjax.decode ... --config.lower_only=cuda`).

XLA runs a `while` loop whose trip count is data on GPU by reading its predicate back to the host every
iteration; a loop inside the round loop therefore costs a host round trip per iteration per round. The
report counts, per program (its StableHLO, calls followed):
- `while_loops`: every while loop; `data_dependent_while_loops`: those whose condition is not a compare
  of the counter with a constant (a scan over layers, a `fori_loop` with static bounds: constant trip
  count, unrolled or run on device without a predicate read);
- `while_loops_in_round`: data-dependent loops nested inside the round loop (the outermost
  data-dependent loop: speculative rounds, or autoregressive steps), at any depth;
- `max_nesting`: the deepest nesting of while loops;
- `custom_calls`: the custom-call targets and how often each appears (kernels: Triton, Mosaic, cuDNN);
- `host_transfers`: sends, receives, in/outfeeds and host callbacks;
- `weight_dequantizations`: conversions of 8-bit integer tensors of rank >= 2 to floating point: the
  quantized weights' XLA path (`specjax.models.quantized`): per matmul the program holds (calls
  followed, once per appearance) one for int8 weights, two for int4 (one per half of its groups); XLA
  fuses each into its dot's operand on GPU/TPU.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import jax

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
_HOST_OPS = ("stablehlo.send", "stablehlo.recv", "stablehlo.infeed", "stablehlo.outfeed")
_INT8_TENSOR = re.compile(r"tensor<\d+x[\dx]*(u?i8)>")  # rank >= 2, 8-bit integer elements


def _dequantizes(op) -> bool:
  """A `stablehlo.convert` of an 8-bit integer tensor of rank >= 2 to floating point."""
  result = str(op.results[0].type)
  return bool(_INT8_TENSOR.fullmatch(str(op.operands[0].type))) and re.search(r"x[bf]+\d+>$", result) is not None


def call_or_lower(jitted, lower: bool | str, *args, **kwargs):
  """`jitted(*args, **kwargs)` (a `jax.jit` function), or with `lower` its program lowered: for the
  default backend (True) or for the platform `lower` names (one of PLATFORMS; no such device needed)."""
  if not lower:
    return jitted(*args, **kwargs)
  traced = jitted.trace(*args, **kwargs)
  return traced.lower() if lower is True else traced.lower(lowering_platforms=(lower,))


def _name(op) -> str:
  return op.operation.name


def _ops(region):
  for block in region.blocks:
    yield from block.operations


def _defining_op(value):
  """The operation that produced `value`, or None for a block argument (a loop carry)."""
  owner = value.owner
  return owner if hasattr(owner, "name") and hasattr(owner, "operands") else None


def _constant_trip_count(while_op) -> bool:
  """True when the loop's condition compares a value with a constant defined in the condition (a scan or
  a `fori_loop` with static bounds), False when the bound is data (a carry or anything computed)."""
  ops = list(_ops(while_op.regions[0]))
  names = [_name(op) for op in ops]
  if sorted(set(names)) != ["stablehlo.compare", "stablehlo.constant", "stablehlo.return"]:
    return False
  compare = next(op for op in ops if _name(op) == "stablehlo.compare")
  producers = [_defining_op(v) for v in compare.operands]
  return any(p is not None and p.name == "stablehlo.constant" for p in producers)


def _size(region_or_op, functions) -> int:
  """Operations inside (regions and called functions included): how much a loop's body holds."""
  regions = region_or_op.regions if hasattr(region_or_op, "regions") else [region_or_op]
  total = 0
  for region in regions:
    for op in _ops(region):
      total += 1 + _size(op, functions)
      if _name(op) == "func.call":
        total += _size(functions[op.attributes["callee"].value], functions)
  return total


class _Walk:
  """One pass over a module's main function, calls followed, counting what `report` holds. Each
  data-dependent loop outside every other loop is a candidate for the round loop: its size and the
  data-dependent loops inside it are kept (`outermost`); the round loop is the largest (the generation
  loop: the prefill's loops are smaller and come before it)."""
  def __init__(self, module):
    self.functions = {op.attributes["sym_name"].value: op for op in module.body.operations if _name(op) == "func.func"}
    self.outermost: list[list[int]] = []  # [size, data-dependent loops inside] per candidate, in order
    self.while_loops = self.data_dependent = self.max_nesting = self.host_transfers = self.dequantizations = 0
    self.custom_calls: collections.Counter = collections.Counter()
    self.region(self.functions["main"].regions[0], 0, None)

  def region(self, region, depth: int, owner: int | None) -> None:
    """Counts `region`'s operations; `owner` indexes the outermost data-dependent loop it lies in."""
    for op in _ops(region):
      name = _name(op)
      if name == "func.call":
        self.region(self.functions[op.attributes["callee"].value].regions[0], depth, owner)
        continue
      inner_owner = owner
      if name == "stablehlo.while":
        self.while_loops += 1
        self.max_nesting = max(self.max_nesting, depth + 1)
        if not _constant_trip_count(op):
          self.data_dependent += 1
          if owner is not None:
            self.outermost[owner][1] += 1
          elif depth == 0:
            inner_owner = len(self.outermost)
            self.outermost.append([_size(op, self.functions), 0])
      elif name == "stablehlo.custom_call":
        target = op.attributes["call_target_name"].value
        self.custom_calls[target] += 1
        self.host_transfers += "callback" in target
      self.host_transfers += name in _HOST_OPS
      self.dequantizations += name == "stablehlo.convert" and _dequantizes(op)
      for inner in op.regions:
        self.region(inner, depth + (name == "stablehlo.while"), inner_owner)


def report(lowered: jax.stages.Lowered) -> dict[str, Any]:
  """The counts the module docstring lists, for one lowered program."""
  walk = _Walk(lowered.compiler_ir("stablehlo"))
  in_round = max(walk.outermost, key=lambda candidate: candidate[0])[1] if walk.outermost else 0
  return {
      "while_loops": walk.while_loops, "data_dependent_while_loops": walk.data_dependent,
      "while_loops_in_round": in_round, "max_nesting": walk.max_nesting,
      "custom_calls": dict(sorted(walk.custom_calls.items())), "host_transfers": walk.host_transfers,
      "weight_dequantizations": walk.dequantizations
  }
