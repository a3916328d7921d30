"""The K policy: how many draft tokens a round proposes. `policy` holds the jitted policies (the fixed
null policy and the adaptive one) and the plan they hand each round; `tuning` what a decoder measures
and learns for them on the host; `cost_store` the measured cost tables kept on disk."""

from specjax.speculative.k_policy.policy import (AUTO, KINDS, Adaptive, Candidate, KPolicy, PolicyState, Tables,
                                                 expected_committed, labels, parse)
from specjax.speculative.k_policy.tuning import (MAX_EXTENSIONS, MEMORY_ROUNDS, MIN_TIMED_S, PRIOR_ROUNDS, Memory,
                                                 Tuning, calibrate, forcing)

__all__ = ["AUTO", "KINDS", "MAX_EXTENSIONS", "MEMORY_ROUNDS", "MIN_TIMED_S", "PRIOR_ROUNDS", "Adaptive", "Candidate",
           "KPolicy", "Memory", "PolicyState", "Tables", "Tuning", "calibrate", "expected_committed", "forcing",
           "labels", "parse"]
