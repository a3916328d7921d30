"""The distillation tests' tiny target and run setup: a random 2-layer model of `tests.helpers.tiny_hf`
plus a character-level tokenizer of exactly its vocabulary, saved as a Hugging Face directory that
`specjax.models.load.load_model` (and `transformers`) read like a real checkpoint; the tiny run config,
its metrics records, and the module fixture `target` (import it into a test
module to use it there)."""

import json
import os
import string

import pytest
import tokenizers

from configs import distill_tiny
from specjax.distill import log, train
from tests.helpers.tiny_hf import VOCAB, save_hf_model

EOS = "<|endoftext|>"


def tiny_tokenizer() -> tokenizers.Tokenizer:
  """EOS, UNK and 95 single characters (no merges): VOCAB ids, any text encodes."""
  chars = (" \n" + string.ascii_letters + string.digits + string.punctuation)[:VOCAB - 2]
  vocab = {EOS: 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>"))
  backend.add_special_tokens([EOS])
  backend.decoder = tokenizers.decoders.Fuse()
  return backend


def save_tiny_target(directory: str, family: str = "llama", seed: int = 0) -> str:
  """The tiny target of `family` with `tiny_tokenizer`, EOS id 0 and no BOS, saved in `directory`."""
  save_hf_model(family, directory, seed)
  for name in ("config.json", "generation_config.json"):  # the families' default ids are characters here
    with open(os.path.join(directory, name)) as f:
      config = json.load(f)
    with open(os.path.join(directory, name), "w") as f:
      json.dump({**config, "eos_token_id": 0, "bos_token_id": None}, f)
  tiny_tokenizer().save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": EOS, "unk_token": "<unk>"}, f)
  return directory


@pytest.fixture(scope="module")
def target(tmp_path_factory):
  """The tiny target's directory, saved once per module."""
  return save_tiny_target(str(tmp_path_factory.mktemp("target")))


def distill_config(target, directory, module=distill_tiny, **changes):
  """The tiny config (`module`'s: configs/distill_tiny.py or one of its variants) for `target` working in
  `directory`, with `changes` (nested fields joined by "__")."""
  config = module.get_config()
  config.target, config.workdir = target, str(directory)
  for path, value in changes.items():
    *parents, leaf = path.split("__")
    node = config
    for parent in parents:
      node = node[parent]
    node[leaf] = value
  return config


def read_records(workdir):
  """metrics.jsonl without its one nondeterministic field (throughput)."""
  with open(os.path.join(workdir, log.METRICS_FILE)) as f:
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in f]


class Crash(Exception):
  """Raised from a run's `on_step` callback to interrupt it, as a kill would."""


def killed_and_resumed(make_config, kill_at: int) -> dict:
  """The summary of a run of `make_config()` killed after step `kill_at` (an exception from `on_step`),
  then started again on the same config to the end: what a resumed run reports."""
  def crash(step, metrics):
    if step == kill_at:
      raise Crash()

  with pytest.raises(Crash):
    train.run(make_config(), on_step=crash)
  return train.run(make_config())
