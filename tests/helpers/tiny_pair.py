"""A tiny random target and draft to try every command on without real weights:

  python -m tests.helpers.tiny_pair /tmp/specjax-tiny   # writes /tmp/specjax-tiny/{target,draft}

Two 2-layer Qwen2 directories (seeds 0 and 1, `save_pretrained` through `transformers`, so the test
extras are needed) with the 97-id character tokenizer; `configs/tiny.py` is the decode config for them.
Their output is noise: they exercise the machinery, not the speed or the acceptance."""

import os
import sys

from tests.helpers.tiny_hf import save_char_tokenizer, save_hf_model


def write_tiny_pair(directory: str) -> list[str]:
  """[target, draft] directories under `directory` (created if missing)."""
  dirs = []
  for name, seed in (("target", 0), ("draft", 1)):
    path = os.path.join(directory, name)
    os.makedirs(path, exist_ok=True)
    save_hf_model("qwen2", path, seed=seed)
    save_char_tokenizer(path)
    dirs.append(path)
  return dirs


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit("usage: python -m tests.helpers.tiny_pair DIRECTORY")
  print("\n".join(write_tiny_pair(sys.argv[1])))
