"""`load_model`: a registry name, a `.gguf` file or a Hugging Face directory -> config, params, tokenizer.

Converting a GGUF is slow (parsing the metadata of a 150k-token vocabulary takes ~12 s with
`gguf.GGUFReader`, dequantizing the 1.5B model ~40 s), so the first load writes the float32 params
(safetensors, config in its metadata) and the tokenizer to `$SPECJAX_CACHE/converted/KEY/`; later loads
read them back tensor by tensor. KEY is the registry sha256 for named models and a hash of path, size
and mtime for other files. Registry models are never fetched implicitly: the error names the command.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from specjax.models import gguf_loader, registry
from specjax.models.config import ModelConfig
from specjax.models.hf import load_hf_dir
from specjax.models.layout import to_layout
from specjax.models.tokenizer import Tokenizer
from specjax.models.transformer import Params

_CACHE_VERSION = "1"  # bump when the converted layout changes


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  name: str  # registry name, or the file / directory name
  config: ModelConfig
  params: Params  # nested dict of arrays in config.dtype
  tokenizer: Tokenizer


SCAN_LAYERS = ("auto", "on", "off")


def scan_layers_for(setting: str, backend: str | None = None) -> bool:
  """`scan_layers` "on" / "off", or "auto": on for GPU/TPU (compile time flat in depth), off on CPU."""
  if setting not in SCAN_LAYERS:
    raise ValueError(f"scan_layers must be one of {SCAN_LAYERS}, got {setting!r}")
  if setting == "auto":
    return (backend or jax.default_backend()) != "cpu"
  return setting == "on"


def with_execution(model: LoadedModel, scan_layers: bool, attention_block: int,
                   prefill_chunk: int) -> LoadedModel:
  """`model` set up to run with these execution settings (its params restacked if the layout changes)."""
  config = model.config.replace(scan_layers=scan_layers, attention_block=attention_block,
                                prefill_chunk=prefill_chunk)
  return dataclasses.replace(model, config=config, params=to_layout(config, model.params))


def load_model(name_or_path: str, dtype: str = "float32") -> LoadedModel:
  """Loads a registry model (fetched beforehand), a `.gguf` file or a Hugging Face directory."""
  if name_or_path in registry.MODELS:
    spec = registry.MODELS[name_or_path]
    if not registry.is_installed(spec):
      raise FileNotFoundError(f"model {spec.name!r} is not installed in {registry.cache_dir()}; "
                              f"run `{registry.fetch_command(spec.name)}` first")
    return _load_gguf_cached(registry.model_path(spec), spec.name, spec.sha256, dtype)
  path = os.path.abspath(os.path.expanduser(name_or_path))
  name = os.path.basename(path.rstrip(os.sep))
  if os.path.isdir(path):
    config, params = load_hf_dir(path, dtype)
    return LoadedModel(name, config, params, Tokenizer.from_hf_dir(path))
  if os.path.isfile(path):
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return _load_gguf_cached(path, name.removesuffix(".gguf"), key, dtype)
  raise FileNotFoundError(f"{name_or_path}: no such file or directory, and not a registry model "
                          f"(known: {', '.join(registry.MODELS)})")


def _cast_in_place(tree: dict, dtype: str) -> None:
  """Casts every leaf, dropping each float32 original as soon as its copy exists (peak + 1 tensor)."""
  for key, value in tree.items():
    if isinstance(value, dict):
      _cast_in_place(value, dtype)
    else:
      tree[key] = value.astype(dtype)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    flat.update(_flatten(value, path + "/") if isinstance(value, dict) else {path: value})
  return flat


def _load_gguf_cached(path: str, name: str, key: str, dtype: str) -> LoadedModel:
  directory = os.path.join(registry.cache_dir(), "converted", key[:32])
  params_file, tokenizer_file = (os.path.join(directory, f) for f in ("params.safetensors", "tokenizer.json"))
  if os.path.isfile(params_file) and os.path.isfile(tokenizer_file):
    meta, tensors = _read_safetensors(params_file)
    if meta.get("version") == _CACHE_VERSION:
      config = ModelConfig.from_dict({**json.loads(meta["config"]), "dtype": dtype})
      params: dict = {}
      for tensor_path, array in tensors:
        *parents, leaf = tensor_path.split("/")
        node = params
        for parent in parents:
          node = node.setdefault(parent, {})
        # float32: an aligned host buffer becomes the array without a copy
        node[leaf] = jax.device_put(array) if dtype == "float32" else jnp.asarray(array, dtype)
      with open(tokenizer_file) as f:
        return LoadedModel(name, config, params, Tokenizer.from_dict(json.load(f)))

  reader = gguf_loader.open_gguf(path)
  tokenizer = Tokenizer.from_gguf(reader)
  config, params = gguf_loader.load_gguf(path, "float32", reader)
  del reader
  os.makedirs(directory, exist_ok=True)
  _write_atomically(tokenizer_file, lambda tmp: _dump_json(tokenizer.to_dict(), tmp))
  meta = {"version": _CACHE_VERSION, "source": path, "config": json.dumps(dataclasses.asdict(config))}
  _write_atomically(params_file, lambda tmp: safetensors.numpy.save_file(  # views, no copies
      {k: np.asarray(v) for k, v in _flatten(params).items()}, tmp, metadata=meta))
  if dtype != "float32":
    _cast_in_place(params, dtype)
    config = config.replace(dtype=dtype)
  return LoadedModel(name, config, params, tokenizer)


def _read_safetensors(file: str) -> tuple[dict[str, str], Iterator[tuple[str, np.ndarray]]]:
  """Metadata and (name, float32 array) of a float32 safetensors file, each array read into a fresh
  64-byte-aligned buffer: XLA's CPU client then adopts it as is (one copy from disk, no second one)."""
  with open(file, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(header_len))
  meta = header.pop("__metadata__", {})

  def tensors():
    with open(file, "rb") as f:
      for name, info in header.items():
        if info["dtype"] != "F32":
          raise ValueError(f"{file}: {name} is {info['dtype']}, the cache holds float32 only")
        begin, end = info["data_offsets"]
        raw = np.empty(end - begin + 64, np.uint8)
        start = -raw.ctypes.data % 64
        buffer = raw[start:start + end - begin]
        f.seek(8 + header_len + begin)
        f.readinto(memoryview(buffer))
        yield name, buffer.view(np.float32).reshape(info["shape"])

  return meta, tensors()


def _dump_json(obj: Any, file: str) -> None:
  with open(file, "w") as f:
    json.dump(obj, f)


def _write_atomically(file: str, write) -> None:
  """`write(tmp)` then rename, so an interrupted conversion never leaves a half file that looks done."""
  tmp = f"{file}.tmp{os.getpid()}"
  try:
    write(tmp)
    os.replace(tmp, file)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
