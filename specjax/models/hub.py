"""Hugging Face hub names: `org/name` or `org/name@revision` -> a local snapshot directory.

`huggingface_hub.snapshot_download` resolves the name, so its rules hold: the cache is
`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` (the `models--org--name/` folders
`transformers` fills); a cached snapshot is used as is, what is missing is downloaded, and with
`HF_HUB_OFFLINE=1` nothing is: a name not in the cache is then an error. huggingface_hub reads these
variables when it is first imported, so set them before the program starts. The revision (a branch,
tag or commit hash) defaults to `main`. Only the files the Hugging Face directory loader reads are
fetched (`HUB_FILES`: config, tokenizer and safetensors weights with their index), never a
repository's PyTorch `.bin`, GGUF or ONNX copies.
"""

from __future__ import annotations

import re

import huggingface_hub
from huggingface_hub import constants, errors

# What `hf.load_hf_dir` and `Tokenizer.from_hf_dir` read.
HUB_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "*.safetensors", "model.safetensors.index.json")
_HUB_NAME = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
# Failures of a look-up: not cached (or cached incompletely) when offline or unreachable, an unknown
# repository or revision, a gated one, an invalid repo id.
_LOOKUP_ERRORS = (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, errors.HFValidationError,
                  errors.OfflineModeIsEnabled)


def parse(name: str) -> tuple[str, str | None] | None:
  """(repo id, revision or None) of a hub name `org/name[@revision]`; None when `name` is not one."""
  match = _HUB_NAME.fullmatch(name)
  return (match["repo"], match["revision"]) if match else None


def snapshot(name: str) -> str:
  """The local directory of hub model `name` (`org/name[@revision]`), from the cache or downloaded.

  Raises FileNotFoundError with a one-line message when it cannot be had (offline and not cached, or
  the hub cannot be reached, or it does not know the repository or revision)."""
  repo_id, revision = parse(name)
  try:
    return huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES))
  except _LOOKUP_ERRORS as e:
    if constants.is_offline_mode():
      reason = (f"not in the Hugging Face cache {constants.HF_HUB_CACHE} and HF_HUB_OFFLINE is set: "
                f"download it where the hub is reachable (`hf download {repo_id}`) or unset HF_HUB_OFFLINE")
    else:
      cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      reason = f"not in the Hugging Face cache {constants.HF_HUB_CACHE} and not fetched from the hub ({cause})"
    raise FileNotFoundError(f"{name}: no such file or directory, not a registry model, and as a hub "
                            f"model {reason}") from None
