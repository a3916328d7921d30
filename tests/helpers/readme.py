"""Code blocks of the README, so that tests run its examples as a reader would copy them."""

import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "README.md")


def python_block(containing: str) -> str:
  """The README's one ```python block that contains `containing`."""
  with open(README) as f:
    blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
  found = [block for block in blocks if containing in block]
  assert len(found) == 1, f"{len(found)} README python blocks contain {containing!r}"
  return found[0]
