"""`load_model`: a local `.gguf` file or Hugging Face directory, a registry name or a Hugging Face hub
name (`org/name[@revision]`, see `hub`) -> config, params, tokenizer.

Precedence, for a name that could be several: an existing local path wins (a directory you made is
never shadowed), then a registry name, then a hub name (resolved through the HF cache, downloading
only when not offline).

Converting a GGUF is slow (parsing the metadata of a 150k-token vocabulary takes ~12 s with
`gguf.GGUFReader`, dequantizing the 1.5B model ~40 s), so the first load writes the float32 params
(safetensors, config in its metadata) and the tokenizer to `$SPECJAX_CACHE/converted/KEY/`; later loads
read them back tensor by tensor. KEY is the registry sha256 for named models and a hash of path, size
and mtime for other files. Registry models are never fetched implicitly: the error names the command.
Quantized weights (`weights`, `quantized`) are cached the same way, per format and dtype, beside them
(`weights-int4-32-float32.safetensors`: codes and float32 scales); a load that finds them reads only
the float tensors that stay float (the embedding, norms, biases) from the converted cache.

Handed a `ParamSharding` (the caller's: this package knows no mesh rules), every loader places each
tensor straight into its shards as it reads it: no device ever holds a whole sharded weight and the
host holds one tensor at a time (a GGUF's first conversion dequantizes on the host and writes the
cache, which is then read).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Collection, Iterator, Protocol

import jax
import numpy as np
import safetensors.numpy

from specjax.models import gguf_loader, hub, quantized, registry
from specjax.models.config import ModelConfig
from specjax.models.execution import Execution
from specjax.models.hf import hf_config, load_hf_dir
from specjax.models.layout import to_layout
from specjax.models.param_tree import on_one_device
from specjax.models.tokenizer import Tokenizer
from specjax.models.transformer import Params

_CACHE_VERSION = "1"  # bump when the converted layout changes
_QUANTIZED_VERSION = "1"  # bump when `quantized.quantize` or its stored layout changes
_DTYPES = {"F32": np.float32, "I8": np.int8, "U8": np.uint8}  # what the cache files hold


class ParamSharding(Protocol):
  """How a model's parameters lie on a device mesh, decided by the caller. Kept, opaque, in
  `LoadedModel.part` for the code that runs the model (its caches, its inputs)."""
  def placement(self, config: ModelConfig) -> Callable[[str, Any], jax.Array]:
    """`place(path, host_array)`: the parameter in `config.dtype`, each device receiving its own shard."""

  def shard(self, config: ModelConfig, params: Params) -> Params:
    """`params` (device arrays, either layout) laid out on the mesh."""


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  name: str  # registry name, hub name, or the file / directory name
  config: ModelConfig
  params: Params  # nested dict of arrays in config.dtype
  tokenizer: Tokenizer
  part: ParamSharding | None = None  # how params (and its caches) lie on a mesh; None: one device


def with_execution(model: LoadedModel, execution: Execution, part: ParamSharding | None = None) -> LoadedModel:
  """`model` set up to run as `execution` says (`Execution.resolve`): its config's execution fields set,
  its params restacked if the layout changes, and laid out by `part` on its mesh."""
  config = model.config.replace(**execution.fields())
  params = to_layout(config, model.params)
  if part is not None:
    params = part.shard(config, params)
  return dataclasses.replace(model, config=config, params=params, part=part)


def load_model(name_or_path: str, dtype: str = "float32", part: ParamSharding | None = None,
               weights: str = "float") -> LoadedModel:
  """Loads a `.gguf` file or Hugging Face directory, a registry model (fetched beforehand) or a hub
  model `org/name[@revision]`, in that order of precedence (see the module docstring); with `part`,
  every weight straight into its shards on its mesh. `weights` (`quantized.parse`: "float", "int8",
  "int4", "int4:G", "int4a8", "int4a8:G") quantizes the loaded weights (`quantized.quantize_params`, on
  the device, weight by weight); a format the model cannot take fails with a `quantized.FormatError`
  before any tensor is read."""
  fmt = quantized.parse(weights)
  if fmt is not None and part is not None:
    raise quantized.FormatError(f"{weights}: quantized weights on a mesh are not supported yet")
  placement = on_one_device if part is None else part.placement
  name, path, gguf_key = _locate(name_or_path)
  if gguf_key is None:
    _check_format(hf_config(path), fmt)
    config, params = load_hf_dir(path, dtype, placement)
    params = quantized.quantize_params(config, params, fmt)
    return LoadedModel(name, config, params, Tokenizer.from_hf_dir(path), part)
  params_file, tokenizer_file = _converted(path, gguf_key)
  meta, _ = _read_safetensors(params_file)
  config = ModelConfig.from_dict({**json.loads(meta["config"]), "dtype": dtype})
  _check_format(config, fmt)
  quantized_file = fmt and os.path.join(os.path.dirname(params_file),
                                        f"weights-{fmt.stored.name.replace(':', '-')}-{dtype}.safetensors")
  cached = _read_quantized(quantized_file, config, fmt) if fmt else {}
  place = placement(config)
  params: dict = {}
  for tensor_path, array in _read_safetensors(params_file, skip=cached)[1]:
    _set(params, tensor_path, place(tensor_path, array))
  for tensor_path, weight in cached.items():
    _set(params, tensor_path, weight)
  if fmt and not cached:
    params = quantized.quantize_params(config, params, fmt)
    _write_quantized(quantized_file, params, fmt, dtype, path)
  return LoadedModel(name, config, params, _read_tokenizer(tokenizer_file), part)


def _set(params: dict, tensor_path: str, value: Any) -> None:
  *parents, leaf = tensor_path.split("/")
  for parent in parents:
    params = params.setdefault(parent, {})
  params[leaf] = value


def _quantized_meta(fmt: quantized.WeightFormat, dtype: str) -> dict[str, str]:
  return {"version": _QUANTIZED_VERSION, "format": fmt.stored.name, "dtype": dtype}


def _write_quantized(file: str, params: Params, fmt: quantized.WeightFormat, dtype: str, source: str) -> None:
  """Writes the quantized weights of `params` (per-layer layout) beside the converted float32 cache:
  `PATH/codes` as stored, `PATH/scales` in float32 (bfloat16 ones are exact in it)."""
  flat = {}
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda node: isinstance(node, quantized.QuantizedWeight))[0]:
    if isinstance(leaf, quantized.QuantizedWeight):
      name = "/".join(k.key for k in key_path)
      flat[f"{name}/codes"] = np.asarray(leaf.codes)
      flat[f"{name}/scales"] = np.asarray(leaf.scales, np.float32)
  meta = {**_quantized_meta(fmt, dtype), "source": source}
  _write_atomically(file, lambda tmp: safetensors.numpy.save_file(flat, tmp, metadata=meta))


def _read_quantized(file: str, config: ModelConfig, fmt: quantized.WeightFormat) -> dict[str, Any]:
  """Parameter path -> `QuantizedWeight` from a file `_write_quantized` wrote for this format and
  dtype (on the default device); {} when there is none (or it is of another version)."""
  if not os.path.isfile(file):
    return {}
  meta, tensors = _read_safetensors(file)
  if {k: meta.get(k) for k in ("version", "format", "dtype")} != _quantized_meta(fmt, config.dtype):
    return {}
  parts: dict[str, dict[str, np.ndarray]] = {}
  for name, array in tensors:
    path, _, part = name.rpartition("/")
    parts.setdefault(path, {})[part] = array
  return {
      path: quantized.QuantizedWeight(jax.device_put(part["codes"]),
                                      jax.device_put(part["scales"].astype(fmt.scale_dtype)), fmt,
                                      config.jnp_dtype) for path, part in parts.items()
  }


def _check_format(config: ModelConfig, fmt: quantized.WeightFormat | None) -> None:
  """A `quantized.FormatError` when the model of `config` cannot take the weight format `fmt`."""
  error = fmt and quantized.format_error(config, fmt)
  if error:
    raise quantized.FormatError(error)


def load_tokenizer(name_or_path: str) -> tuple[Tokenizer, ModelConfig]:
  """The tokenizer and config of the model `load_model` would load, without reading its weights (a
  vocabulary map needs the tokenizer and the ids the head scores, `config.vocab_size`)."""
  _, path, gguf_key = _locate(name_or_path)
  if gguf_key is None:
    return Tokenizer.from_hf_dir(path), hf_config(path)
  params_file, tokenizer_file = _converted(path, gguf_key)
  meta, _ = _read_safetensors(params_file)
  return _read_tokenizer(tokenizer_file), ModelConfig.from_dict(json.loads(meta["config"]))


def _locate(name_or_path: str) -> tuple[str, str, str | None]:
  """(the model's name, its HF directory or GGUF file, the GGUF's converted-cache key or None for a
  directory), by `load_model`'s precedence; a registry model that is not fetched fails naming the command."""
  path = os.path.abspath(os.path.expanduser(name_or_path))
  name = os.path.basename(path.rstrip(os.sep))
  if os.path.isdir(path):
    return name, path, None
  if os.path.isfile(path):
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return name.removesuffix(".gguf"), path, key
  if name_or_path in registry.MODELS:
    spec = registry.MODELS[name_or_path]
    if not registry.is_installed(spec):
      raise FileNotFoundError(f"model {spec.name!r} is not installed in {registry.cache_dir()}; "
                              f"run `{registry.fetch_command(spec.name)}` first")
    return spec.name, registry.model_path(spec), spec.sha256
  if hub.parse(name_or_path):
    return name_or_path, hub.snapshot(name_or_path), None
  raise FileNotFoundError(f"{name_or_path}: no such file or directory, and not a registry model "
                          f"(known: {', '.join(registry.MODELS)}) nor a hub name org/name[@revision]")


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    flat.update(_flatten(value, path + "/") if isinstance(value, dict) else {path: value})
  return flat


def _converted(path: str, key: str) -> tuple[str, str]:
  """The converted cache's params and tokenizer files of the GGUF at `path`, converting it first if they
  are missing or of another cache version."""
  directory = os.path.join(registry.cache_dir(), "converted", key[:32])
  params_file, tokenizer_file = (os.path.join(directory, f) for f in ("params.safetensors", "tokenizer.json"))
  if not (os.path.isfile(params_file) and os.path.isfile(tokenizer_file) and
          _read_safetensors(params_file)[0].get("version") == _CACHE_VERSION):
    _convert(path, directory, params_file, tokenizer_file)
  return params_file, tokenizer_file


def _read_tokenizer(file: str) -> Tokenizer:
  with open(file) as f:
    return Tokenizer.from_dict(json.load(f))


def _convert(path: str, directory: str, params_file: str, tokenizer_file: str) -> None:
  """Dequantizes the GGUF at `path` to float32 on the host and writes the converted cache."""
  reader = gguf_loader.open_gguf(path)
  tokenizer = Tokenizer.from_gguf(reader)
  config, params = gguf_loader.load_gguf(path, "float32", reader,
                                         placement=lambda config: lambda _, array: np.asarray(array, np.float32))
  del reader
  os.makedirs(directory, exist_ok=True)
  _write_atomically(tokenizer_file, lambda tmp: _dump_json(tokenizer.to_dict(), tmp))
  meta = {"version": _CACHE_VERSION, "source": path, "config": json.dumps(dataclasses.asdict(config))}
  _write_atomically(params_file, lambda tmp: safetensors.numpy.save_file(_flatten(params), tmp, metadata=meta))


def _read_safetensors(file: str, skip: Collection[str] = ()) -> tuple[dict[str, str], Iterator[tuple[str, np.ndarray]]]:
  """Metadata and (name, array) of a safetensors file of float32 (the converted cache) or 8-bit integer
  tensors (quantized codes) but those named in `skip` (never read), each array read into a fresh
  64-byte-aligned buffer: XLA's CPU client then adopts it as is (one copy from disk, no second one)."""
  with open(file, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(header_len))
  meta = header.pop("__metadata__", {})

  def tensors():
    with open(file, "rb") as f:
      for name, info in header.items():
        if name in skip:
          continue
        if info["dtype"] not in _DTYPES:
          raise ValueError(f"{file}: {name} is {info['dtype']}, the cache holds {', '.join(_DTYPES)} only")
        begin, end = info["data_offsets"]
        raw = np.empty(end - begin + 64, np.uint8)
        start = -raw.ctypes.data % 64
        buffer = raw[start:start + end - begin]
        f.seek(8 + header_len + begin)
        f.readinto(memoryview(buffer))
        yield name, buffer.view(_DTYPES[info["dtype"]]).reshape(info["shape"])

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
