"""The execution record (`specjax.models.execution`): "auto" settings resolved per platform, bad settings
refused naming their field, one resolution per model of a decode (the spec's record is what the loaded
models run), and the numerics mode named by the models and the run's results."""

import jax.numpy as jnp
import pytest

from specjax import decode_spec, pipeline
from specjax.errors import ConfigError
from specjax.models import matmul
from specjax.models.config import BATCH_INVARIANT, FAST
from specjax.models.execution import FIELDS, Execution, resolve_dtype
from tests.helpers.cli import cli_config, model_dirs  # noqa: F401 (the fixture)
from tests.helpers.engine import tiny_model

AUTO = {
    "scan_layers": "auto", "attention": "auto", "attention_block": 16, "prefill_chunk": 8, "narrow_passes": "auto",
    "matmul": "auto"
}


@pytest.mark.parametrize("platform, scan_layers, attention, narrow_passes", [("cpu", False, "blockwise", True),
                                                                             ("cuda", True, "kernel", False),
                                                                             ("tpu", True, "blockwise", True)])
def test_auto_settings_resolve_for_the_platform_the_program_is_for(platform, scan_layers, attention, narrow_passes):
  record = Execution.resolve(AUTO, "float32", platform=platform)
  assert (record.scan_layers, record.attention, record.narrow_passes) == (scan_layers, attention, narrow_passes)
  assert (record.attention_block, record.prefill_chunk) == (16, 8)
  assert record.matmul == "xla"  # float32 stays on XLA under "auto" (GPU/TPU: always)
  assert set(record.fields()) == set(FIELDS)


def test_explicit_settings_and_the_interpreted_kernel_on_cpu():
  record = Execution.resolve(
      {**AUTO, "scan_layers": "on", "attention": "kernel", "narrow_passes": "off", "matmul": "xla"}, "bfloat16",
      platform="cpu")
  assert (record.scan_layers, record.attention, record.narrow_passes, record.matmul) == (True, "kernel_interpret",
                                                                                         False, "xla")


@pytest.mark.parametrize("kernel_runs, matmul_setting, platform, dtype", [(True, "auto", "cpu", "bfloat16"),
                                                                          (False, "auto", "cpu", "float32"),
                                                                          (True, "xla", "cpu", "float32"),
                                                                          (False, "auto", "cuda", "bfloat16"),
                                                                          (False, "xla", "tpu", "bfloat16")])
def test_dtype_auto_is_bfloat16_where_it_runs_fast_and_float32_elsewhere(monkeypatch, kernel_runs, matmul_setting,
                                                                         platform, dtype):
  """bfloat16 on accelerators and where the CPU kernel takes it; float32 on a CPU whose bfloat16 matmuls
  would run through XLA (about 10x slower). A given dtype is kept as it is; the note says why."""
  monkeypatch.setattr(matmul, "kernel_status", lambda d, w="float": (kernel_runs, "no AVX2 here"))
  resolved, note = resolve_dtype("auto", matmul_setting, "float", platform)
  assert resolved == dtype and note.startswith(f"dtype auto: {dtype}")
  assert resolve_dtype("float32", matmul_setting, "float", platform) == ("float32", "")


def test_a_spec_holds_the_dtype_auto_resolved_to(model_dirs, monkeypatch):
  monkeypatch.setattr(matmul, "kernel_status", lambda d, w="float": (False, "no AVX2 here"))
  spec = decode_spec.from_config(cli_config(model_dirs, dtype="auto"))
  assert (spec.config.dtype, spec.dtype_note) == ("float32", "dtype auto: float32, no AVX2 here")
  assert spec.execution.matmul == "xla"
  with pytest.raises(ConfigError, match=r"config.dtype must be one of \('auto', 'float32', 'bfloat16'\)"):
    decode_spec.from_config(cli_config(model_dirs, dtype="float16"))


@pytest.mark.parametrize("field, value, message",
                         [("scan_layers", "maybe", r"^scan_layers must be one of \('auto', 'on', 'off'\)"),
                          ("attention", "flash", r"^attention must be one of"),
                          ("narrow_passes", "yes", r"^narrow_passes must be one of"),
                          ("attention_block", -1, r"^attention_block must be an integer >= 0 \(0 = dense\), got -1"),
                          ("prefill_chunk", 0, r"^prefill_chunk must be an integer >= 1, got 0"),
                          ("matmul", "blas", r"^matmul must be one of")])
def test_a_setting_that_cannot_apply_is_refused_naming_its_field(field, value, message):
  with pytest.raises(ValueError, match=message):
    Execution.resolve({**AUTO, field: value}, "float32", platform="cpu")
  with pytest.raises(ValueError, match="attention='kernel' is the Pallas GPU kernel: tpu has none"):
    Execution.resolve({**AUTO, "attention": "kernel"}, "float32", platform="tpu")


def test_a_decode_resolves_each_models_execution_once_and_loads_what_the_spec_holds(model_dirs, monkeypatch):
  """The spec resolves the target's and the draft's records (two `backend_for` calls, the draft's with
  its own weight format) and loading the models resolves nothing again: each loaded config carries its
  record's fields."""
  calls = []
  real = matmul.backend_for
  monkeypatch.setattr(matmul, "backend_for", lambda *args: calls.append(args) or real(*args))
  spec = decode_spec.from_config(cli_config(model_dirs, drafter="model", model={"weights": "int8"}))
  assert [call[3] for call in calls] == ["float", "int8"]
  target, draft = pipeline.load_models(spec, log=lambda message: None)
  assert len(calls) == 2
  for model, record in ((target, spec.execution), (draft, spec.draft_execution)):
    assert {name: getattr(model.config, name) for name in FIELDS} == record.fields()
  assert pipeline.devices_record(target, draft)["numerics"] == target.config.numerics
  no_draft = decode_spec.from_config(cli_config(model_dirs, drafter="ngram"))
  assert no_draft.execution is not None and no_draft.draft_execution is None


def test_the_numerics_mode_follows_the_matmul_backend_and_sets_the_cache_dtype():
  """Batch-invariant where the CPU kernel runs the weights (its caches float32 whatever the model dtype),
  fast on XLA (caches in the model dtype)."""
  config = tiny_model(0, vocab=8, n_layers=1)[0].replace(dtype="bfloat16")
  assert config.numerics == FAST and config.cache_dtype == jnp.bfloat16
  kernel = config.replace(matmul="cpu_kernel")
  assert kernel.numerics == BATCH_INVARIANT and kernel.cache_dtype == jnp.float32


def test_a_bad_setting_in_a_decode_config_names_the_config_field(model_dirs):
  with pytest.raises(ConfigError, match=r"^config\.attention must be one of"):
    decode_spec.from_config(cli_config(model_dirs, attention="flash"))
