"""The tiny target the distillation tests train against (`tests.helpers.distill`): a random 2-layer model
of `tests.helpers.tiny_hf` with a character-level tokenizer of exactly its vocabulary, loaded from its
Hugging Face directory like a real checkpoint."""

from specjax.models.load import load_model
from tests.helpers.distill import save_tiny_target
from tests.helpers.tiny_hf import VOCAB


def test_tiny_target_loads_with_its_tokenizer(tmp_path):
  model = load_model(save_tiny_target(str(tmp_path)))
  assert model.config.vocab_size == model.tokenizer.vocab_size == VOCAB
  assert model.tokenizer.eos_ids == (0,)
  text = "def f(x):\n    return x + 1  # ok"
  assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
