"""The K policy: how many draft tokens a round proposes. `policy` holds the jitted policies (the fixed
null policy and the adaptive one) and the plan they hand each round; `tuning` what a decoder measures
and learns for them on the host; `cost_store` the measured cost tables kept on disk."""

from specjax.speculative.k_policy.policy import (AUTO, KINDS, Adaptive, Candidate, KPolicy, PolicyState, Tables,
                                                 expected_committed, labels, parse)
from specjax.speculative.k_policy.tuning import (MAX_EXTENSIONS, MEMORY_ROUNDS, MIN_CHECKED_S, MIN_TIMED_S, MISS_LIMIT,
                                                 PRIOR_ROUNDS, Forced, Memory, Prices, Tuning, calibrate,
                                                 forced_round_seconds, forcing, monotone)

__all__ = [
    "AUTO", "KINDS", "MAX_EXTENSIONS", "MEMORY_ROUNDS", "MIN_CHECKED_S", "MIN_TIMED_S", "MISS_LIMIT", "PRIOR_ROUNDS",
    "Adaptive", "Candidate", "Forced", "KPolicy", "Memory", "PolicyState", "Prices", "Tables", "Tuning", "calibrate",
    "expected_committed", "forced_round_seconds", "forcing", "labels", "monotone", "parse"
]
