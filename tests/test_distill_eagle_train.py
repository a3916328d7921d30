"""`specjax.distill` with student.init = "eagle_head" on a tiny target: the loss falls and the held-out
simulated acceptance length rises (metrics.jsonl), the exported head loads as a drafter, a killed run
resumes bit for bit, a NaN loss stops the run."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import distill_eagle_smollm2
from specjax import draft_vocab
from specjax.distill import student, train
from specjax.distill.objectives.eagle import HEAD_VOCAB_FILE
from specjax.errors import ConfigError
from specjax.models.load import load_model
from specjax.models.transformer import output_head
from specjax.speculative.drafters.eagle_io import WEIGHTS_FILE, load_head, save_head
from tests.helpers.distill import Crash, distill_config, read_records
from tests.helpers.distill import target  # noqa: F401 (the fixture)

EAGLE = dict(student__init="eagle_head", student__feature_layers="0,1", student__ttt_steps=3, num_steps=20,
             eval_every=10, checkpoint_every=5, optim__learning_rate=3e-3, data__modes__fixed=0.5,
             data__modes__target=0.5)


@pytest.mark.slow
def test_head_training_lowers_the_loss_and_raises_the_acceptance_length(target, tmp_path):
  summary = train.run(distill_config(target, tmp_path, **EAGLE))
  records = read_records(tmp_path)
  train_losses = [r["loss"] for r in records if r["split"] == "train"]
  evals = [r for r in records if r["split"] == "eval"]
  assert [r["step"] for r in evals] == [0, 10, 20]
  assert np.mean(train_losses[-5:]) < 0.8 * np.mean(train_losses[:5])
  assert evals[-1]["loss"] < evals[0]["loss"]
  assert evals[-1]["acceptance_length"] > evals[0]["acceptance_length"] + 0.05
  assert {r["mode"] for r in records if r["split"] == "train"} == {"fixed", "target"}
  teacher = load_model(target)
  config, params, vocab = load_head(summary["export_dir"], teacher.config, teacher.params)
  assert config.feature_layers == (0, 1) and vocab is None
  with open(os.path.join(tmp_path, train.SUMMARY_FILE)) as f:
    assert json.load(f)["student"]["feature_layers"] == [0, 1]


@pytest.mark.slow
def test_interrupted_head_training_resumes_bit_identical(target, tmp_path):
  whole = train.run(distill_config(target, tmp_path / "whole", **EAGLE))

  def crash(step, metrics):
    if step == 8:
      raise Crash()

  with pytest.raises(Crash):
    train.run(distill_config(target, tmp_path / "resumed", **EAGLE), on_step=crash)
  resumed = train.run(distill_config(target, tmp_path / "resumed", **EAGLE))
  assert read_records(tmp_path / "resumed") == read_records(tmp_path / "whole")
  want = load_file(os.path.join(whole["export_dir"], WEIGHTS_FILE))
  got = load_file(os.path.join(resumed["export_dir"], WEIGHTS_FILE))
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
  # The newest checkpoint, read back as the report does, is the exported head.
  _, head_config, head_params, vocab, step = train.latest(distill_config(target, tmp_path / "whole", **EAGLE))
  save_head(str(tmp_path / "latest"), head_config, head_params, vocab)
  latest = load_file(str(tmp_path / "latest" / WEIGHTS_FILE))
  assert step == 20 and vocab is None and latest.keys() == want.keys()
  for name in want:
    np.testing.assert_array_equal(latest[name], want[name], err_msg=name)


def test_a_head_trains_and_exports_over_its_restricted_vocabulary(target, tmp_path):
  """student.draft_vocab: the Vd tokens most frequent in the training rows (EOS included), kept in the work
  directory, exported with the head and read back by `train.latest`; a resume that would rank another
  vocabulary into the same work directory is refused."""
  config = distill_config(
      target, tmp_path, **{**EAGLE, "num_steps": 4, "eval_every": 4, "checkpoint_every": 4, "student__draft_vocab": 24})
  summary = train.run(config)
  teacher = load_model(target)
  rows = train.data.pack(*_training_documents(config, teacher))
  want_Vd = draft_vocab.most_frequent(np.bincount(rows.tokens[rows.mask], minlength=teacher.config.vocab_size), 24,
                                      always=teacher.tokenizer.eos_ids)
  assert set(teacher.tokenizer.eos_ids) <= set(want_Vd.tolist())
  np.testing.assert_array_equal(np.load(tmp_path / HEAD_VOCAB_FILE), want_Vd)
  _, _, vocab = load_head(summary["export_dir"], teacher.config, teacher.params)
  np.testing.assert_array_equal(np.asarray(vocab.tokens_Vd), want_Vd)
  np.testing.assert_array_equal(np.asarray(vocab.weight_VdxD),
                                np.asarray(output_head(teacher.config, teacher.params))[want_Vd])
  assert np.array_equal(np.asarray(train.latest(config)[3].tokens_Vd), want_Vd)
  evals = [r for r in read_records(tmp_path) if r["split"] == "eval"]
  assert all(0.0 < r["acceptance"] < 1.0 and np.isfinite(r["loss"]) for r in evals)
  config.student.draft_vocab, config.num_steps = 25, 8
  with pytest.raises(ConfigError, match="another restricted vocabulary"):
    train.run(config)


def _training_documents(config, teacher):
  """(training documents, encode, seq_len, EOS, cap): what `train._setup` packs into the training rows."""
  docs = train.corpus.read_documents(config.data.source, config.data.pattern, config.data.jsonl_field)
  train_docs, _ = train.data.split_documents(docs, config.data.heldout_fraction, config.seed)
  return (train_docs, teacher.tokenizer.encode, config.data.seq_len, teacher.tokenizer.eos_ids[0],
          config.data.max_train_tokens)


def test_head_training_stops_on_nan_and_refuses_what_it_cannot_do(target, tmp_path):
  config = distill_config(target, tmp_path / "nan",
                          **{**EAGLE, "optim__learning_rate": 1e30, "optim__warmup_steps": 0, "checkpoint_every": 1})
  with pytest.raises(FloatingPointError, match=r"non-finite .* at step 2"):
    train.run(config)
  with pytest.raises(ConfigError, match="'student' data mode"):
    train.run(distill_config(target, tmp_path / "student", **{**EAGLE, "data__modes__student": 1.0}))
  with pytest.raises(ConfigError, match="feature_loss_weight"):
    train.run(distill_config(target, tmp_path / "regression", **{**EAGLE, "student__feature_loss_weight": 1.0}))
  with pytest.raises(ConfigError, match="config.student.draft_vocab"):
    train.run(distill_config(target, tmp_path / "vocab", **{**EAGLE, "student__draft_vocab": 10**6}))
  with pytest.raises(ConfigError, match="config.student.draft_vocab .* 'eagle_head' only"):
    train.run(distill_config(target, tmp_path / "vocab_draft", student__draft_vocab=16))
  with pytest.raises(ValueError, match=r"after target layers \[5\]"):
    train.run(distill_config(target, tmp_path / "layers", **{**EAGLE, "student__feature_layers": "0,5"}))


def test_the_smollm2_head_config_is_valid():
  config = distill_eagle_smollm2.get_config()
  train.check_config(config)
  assert student.feature_layers(config.student.feature_layers, 30) == (1, 14, 26)
