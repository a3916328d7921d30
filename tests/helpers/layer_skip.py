"""Three-layer tiny targets, for the drafters that draft from a subset of the target's layers or from its
features (layer skip, EAGLE), and TARGET's own greedy decoding."""

from tests.helpers.engine import BUDGETS, NO_EOS, PROMPTS, target_greedy, tiny_model

TARGET = tiny_model(0, n_layers=3)
SMALL_TARGET = tiny_model(10, vocab=8, n_layers=3, scale=0.5)


def target_greedy_3(prompts=PROMPTS, budgets=BUDGETS, eos_ids=NO_EOS):
  """The three-layer TARGET's own greedy decoding of `prompts`, as token lists."""
  return target_greedy(prompts, budgets, eos_ids, target=TARGET)
