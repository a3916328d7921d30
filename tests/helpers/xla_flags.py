"""The XLA CPU flags of the test run (set by `tests/conftest.py` for every process it starts).

The tiny models' programs compile ~25% faster unoptimised, and about twice as fast again with XLA CPU's
older elemental emitters instead of its fusion emitters (the tiny speculative and tree programs: 5.4 ->
2.3 s of backend compilation; tests/test_speculative.py 133 -> 52 s). They run fast enough either way
(the suite is mostly compilation). The opt-in real-model tests keep XLA's optimised defaults.
"""

from __future__ import annotations

ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
FAST_COMPILE_FLAGS = f"--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true {ELEMENTAL_EMITTERS}"


def with_fusion_emitters(xla_flags: str) -> str:
  """`xla_flags` with XLA's default fusion emitters back: for a claim about the code XLA emits by default
  (rematerialisation changing no bit holds with them, not with the elemental emitters)."""
  return " ".join(flag for flag in xla_flags.split() if flag != ELEMENTAL_EMITTERS)
