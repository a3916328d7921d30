"""Text <-> token ids for the models specjax loads, built on the `tokenizers` library (no torch).

Two sources: a Hugging Face directory (`tokenizer.json`, `tokenizer_config.json`, optional
`generation_config.json` / `config.json` for the stop ids, `chat_template.jinja`), or a GGUF file's
byte-level BPE metadata (`tokenizer.ggml.{tokens, merges, token_type, pre, bos/eos ids}`), rebuilt the
way the original `tokenizer.json` splits text (`GGUF pre` names llama.cpp's pre-tokenizer), or a Gemma 3
file's SentencePiece vocabulary (rebuilt as transformers' GGUF loader does). Chat
templates render with jinja2 as `transformers` does. `fingerprint()` hashes the id -> token table so the
engine can refuse a draft whose ids mean something else than the target's.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Any, Sequence

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from specjax.models.gguf_loader import metadata, open_gguf

# Tokens that end a turn or a document; stop on any of them (as llama.cpp's end-of-generation set).
END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
               "<EOT>", "<end_of_utterance>")
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED, _UNUSED = 3, 4, 5  # gguf.TokenType
_SENTENCEPIECE_ARCHS = ("gemma3",)  # GGUF architectures whose "llama" tokenizer is Gemma's


def _byte_level(split: str | None) -> pre_tokenizers.PreTokenizer:
  """A regex split (GPT-2's built-in one when None) followed by the byte-to-unicode mapping."""
  if split is None:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  ])


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer) of the model's original tokenizer.json
_GGUF_PRE = {
    "default": lambda: (None, _byte_level(None)),
    "gpt2": lambda: (None, _byte_level(None)),
    "qwen2": lambda: (normalizers.NFC(), _byte_level(_QWEN2_SPLIT)),
    "smollm": lambda: (None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                      _byte_level(None)])),
    "llama-bpe": lambda: (None, _byte_level(_LLAMA3_SPLIT)),
}


def _render_chat(template: str, messages: list[dict], special_tokens: dict[str, str]) -> str:
  """Renders a chat template like transformers' `apply_chat_template(add_generation_prompt=True)`."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[jinja2.ext.loopcontrols])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (json.dumps(
      x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
  return env.from_string(template).render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                          **special_tokens)


class Tokenizer:
  """A `tokenizers.Tokenizer` plus what generation needs: stop ids, BOS, the chat template."""
  def __init__(self, backend: tokenizers.Tokenizer, eos_ids: Sequence[int], chat_template: str | None,
               special_tokens: dict[str, str], unused_ids: Sequence[int] = ()):
    self.backend = backend
    self.eos_ids = tuple(sorted(set(eos_ids)))  # generation stops at any of these
    self.chat_template = chat_template
    self.special_tokens = special_tokens  # bos_token / eos_token / ... strings, for the chat template
    self.unused_ids = tuple(unused_ids)  # padding rows of the vocabulary (GGUF "unused" tokens)
    bos = backend.encode("").ids  # the post-processor's prefix, if any
    self.bos_id = bos[0] if bos else None  # the id `encode` prepends, or None when it adds nothing

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) map to their ids.
    Encode a rendered chat template with `add_special_tokens=False`: the template writes its own BOS."""
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: str | list[dict[str, Any]]) -> str:
    """The prompt text for a conversation (a bare string is one user message), ending with the
    assistant's generation prompt."""
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template")
    if isinstance(messages, str):
      messages = [{"role": "user", "content": messages}]
    return _render_chat(self.chat_template, messages, self.special_tokens)

  def fingerprint(self, below: int | None = None) -> str:
    """sha256 of the id -> (token, kind) table, padding rows excluded: equal for an HF directory and
    a GGUF file of the same model, different as soon as one id means something else. `below` limits
    the table to ids < below: the range two models with differently padded heads share."""
    added = self.backend.get_added_tokens_decoder()
    unused = set(self.unused_ids)
    table = sorted((i, token, "special" if i in added and added[i].special else "added" if i in added else "")
                   for token, i in self.backend.get_vocab(with_added_tokens=True).items()
                   if i not in unused and (below is None or i < below))
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()

  def to_dict(self) -> dict[str, Any]:
    return {
        "backend": self.backend.to_str(), "eos_ids": list(self.eos_ids), "chat_template": self.chat_template,
        "special_tokens": self.special_tokens, "unused_ids": list(self.unused_ids)
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "Tokenizer":
    return cls(tokenizers.Tokenizer.from_str(d["backend"]), d["eos_ids"], d["chat_template"], d["special_tokens"],
               d["unused_ids"])

  @classmethod
  def from_hf_dir(cls, path: str) -> "Tokenizer":
    """From `tokenizer.json` and `tokenizer_config.json`; stop ids from every config that names one."""
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
      raise FileNotFoundError(f"{path}: no tokenizer.json")
    backend = tokenizers.Tokenizer.from_file(tokenizer_file)
    configs = {
        name: _read_json(os.path.join(path, f"{name}.json"))
        for name in ("tokenizer_config", "generation_config", "config")
    }
    tokenizer_config = configs["tokenizer_config"]
    special_tokens = {
        key: _content(tokenizer_config[key])
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if tokenizer_config.get(key)
    }
    eos_ids = []
    for config in (configs["generation_config"], configs["config"]):
      eos = config.get("eos_token_id")
      eos_ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    if "eos_token" in special_tokens:
      eos_ids.append(backend.token_to_id(special_tokens["eos_token"]))
    specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    eos_ids += [specials[t] for t in END_OF_TURN if t in specials]
    template = tokenizer_config.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(template_file):
      with open(template_file) as f:
        template = f.read()
    return cls(backend, [i for i in eos_ids if i is not None], template, special_tokens)

  @classmethod
  def from_gguf(cls, path_or_reader: str | gguf.GGUFReader) -> "Tokenizer":
    """From a GGUF file's tokenizer metadata: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) or
    Gemma's SentencePiece BPE (`"llama"` in a gemma3 file); pass an open reader to avoid parsing a large
    file twice."""
    reader = open_gguf(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader
    model = metadata(reader, "tokenizer.ggml.model")
    sentencepiece = model == "llama" and metadata(reader, "general.architecture") in _SENTENCEPIECE_ARCHS
    if model != "gpt2" and not sentencepiece:
      raise ValueError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE 'gpt2', or 'llama' "
                       f"SentencePiece in {_SENTENCEPIECE_ARCHS} files)")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    backend = _gemma_sentencepiece(tokens) if sentencepiece else _byte_level_bpe(reader, tokens)
    types = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL])
    vocab = backend.get_vocab()  # Gemma's user-defined runs of spaces are respelled there: not added
    backend.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types)
        if k == _USER_DEFINED and t in vocab
    ])
    ids = {
        key: metadata(reader, f"tokenizer.ggml.{key}_token_id")
        for key in ("bos", "eos", "eot", "eom", "unknown", "padding")
    }
    if ids["bos"] is not None and metadata(reader, "tokenizer.ggml.add_bos_token", False):
      bos = tokens[ids["bos"]]
      backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                             special_tokens=[(bos, ids["bos"])])
    special_tokens = {
        f"{name}_token": tokens[ids[key]]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if ids[key] is not None
    }
    control = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == _CONTROL}
    eos_ids = [ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None]
    eos_ids += [control[t] for t in END_OF_TURN if t in control]
    return cls(backend, eos_ids, metadata(reader, "tokenizer.chat_template"), special_tokens,
               [i for i, k in enumerate(types) if k == _UNUSED])


def _byte_level_bpe(reader: gguf.GGUFReader, tokens: list[str]) -> tokenizers.Tokenizer:
  """GPT-2-style BPE over bytes, with the file's merges and the pre-tokenizer its `pre` names."""
  pre = metadata(reader, "tokenizer.ggml.pre", "default")
  if pre not in _GGUF_PRE:
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {sorted(_GGUF_PRE)}")
  merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges", [])]
  backend = tokenizers.Tokenizer(
      tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
  backend.normalizer, backend.pre_tokenizer = _GGUF_PRE[pre]()
  backend.decoder = decoders.ByteLevel()
  return backend


def _gemma_sentencepiece(tokens: list[str]) -> tokenizers.Tokenizer:
  """Gemma's tokenizer rebuilt from a GGUF vocabulary as transformers rebuilds it (its `GemmaTokenizer`):
  BPE with byte fallback over "▁"-for-space text. The file has no merges; they are every split of a
  token into two tokens, ranked by the token's position in the vocabulary (Gemma's scores do not follow
  its merge order, its order does). Tokens of spaces only are stored as spaces and respelled "▁"."""
  tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for token, rank in vocab.items():  # in vocabulary order; a repeated token ranks at its last index
    splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
    merges += [(left, right, rank) for left, right in sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
  merges.sort(key=lambda m: (m[2], -len(m[0]), -len(m[1])))
  backend = tokenizers.Tokenizer(
      tokenizers.models.BPE(vocab, [(left, right) for left, right, _ in merges], fuse_unk=True, unk_token="<unk>",
                            dropout=None, byte_fallback=True))
  backend.normalizer = normalizers.Replace(" ", "▁")
  backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
  backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
  return backend


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _content(token: str | dict) -> str:
  """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
  return token["content"] if isinstance(token, dict) else token
