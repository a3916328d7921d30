"""Distillation data: sources, a split by document, packing, a resumable stream and generation modes."""

import json

import jax
import numpy as np
import pytest

from specjax import corpus
from specjax.distill import data
from specjax.models.transformer import init_params
from specjax.models.config import ModelConfig
from specjax.sampling import sampling_params

encode = lambda text: [ord(c) % 90 + 1 for c in text]  # ids 1..90; 0 is the separator


def test_sources_directory_glob_textfile_jsonl(tmp_path):
  (tmp_path / "pkg").mkdir()
  (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
  (tmp_path / "b.py").write_text("y = 2\n")
  (tmp_path / "empty.py").write_text("  \n")
  (tmp_path / "latin.py").write_bytes(b"\xe9\xe8 = 1\n")
  assert [d.text for d in corpus.read_documents(str(tmp_path))] == ["y = 2\n", "x = 1\n"]  # by path
  assert [d.name for d in corpus.read_documents(str(tmp_path / "*.py"))] == [str(tmp_path / "b.py")]
  (tmp_path / "t.txt").write_text("one\ntwo\n\n\nthree\n")
  assert [d.text.strip() for d in corpus.read_documents(str(tmp_path / "t.txt"))] == ["one\ntwo", "three"]
  (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hi"}) + "\n\n" + json.dumps({"body": "yo"}) + "\n")
  assert [d.text for d in corpus.read_documents(str(tmp_path / "d.jsonl"), jsonl_field="body")] == ["hi", "yo"]
  with pytest.raises(ValueError, match="no string field 'text'"):
    corpus.read_documents(str(tmp_path / "d.jsonl"))


def test_stdlib_source_has_python_files_and_no_site_packages():
  docs = corpus.read_documents(corpus.STDLIB)
  assert len(docs) > 100 and all(d.name.endswith(".py") and "site-packages" not in d.name for d in docs)


@pytest.mark.parametrize("source", ["nowhere/*.py", "DIR"])
def test_empty_data_is_a_clear_error(tmp_path, source):
  with pytest.raises(ValueError, match="no non-empty documents"):
    corpus.read_documents(source.replace("DIR", str(tmp_path)))


def test_split_is_by_document_deterministic_and_disjoint():
  docs = [corpus.Document(str(i), "t") for i in range(20)]
  train, held = data.split_documents(docs, 0.2, seed=3)
  assert len(held) == 4 and len(train) == 16
  assert not {d.name for d in train} & {d.name for d in held}
  assert data.split_documents(docs, 0.2, seed=3) == (train, held)
  assert data.split_documents(docs, 0.2, seed=4) != (train, held)


def test_pack_joins_documents_with_separator_and_masks_padding():
  docs = [corpus.Document("a", "abc"), corpus.Document("b", "de")]
  packed = data.pack(docs, encode, seq_len=3, separator_id=0)
  np.testing.assert_array_equal(packed.tokens, [encode("abc"), [0] + encode("de"), [0, 0, 0]])
  np.testing.assert_array_equal(packed.mask, [[1, 1, 1], [1, 1, 1], [1, 0, 0]])
  assert data.pack(docs, encode, seq_len=3, separator_id=0, max_tokens=4).tokens.shape == (2, 3)


def test_stream_is_random_access_reshuffles_epochs_and_restores():
  packed = data.pack([corpus.Document("a", "abcdefghijklmnopqrstuvwx")], encode, 4, 0)  # 7 rows
  stream = data.BatchStream(packed, batch_size=3, seed=0)
  epoch_rows = np.concatenate([stream.batch(i)[0] for i in range(7)])  # 21 rows = 3 epochs
  for e in range(3):  # every epoch is a permutation of all rows
    assert sorted(map(tuple, epoch_rows[7 * e:7 * e + 7])) == sorted(map(tuple, packed.tokens))
  assert not np.array_equal(epoch_rows[:7], epoch_rows[7:14])
  stream.position = 5
  other = data.BatchStream(packed, batch_size=3, seed=0)
  other.restore(stream.state())
  assert other.position == 5
  changed = data.BatchStream(data.pack([corpus.Document("a", "xyz" * 9)], encode, 4, 0), 3, 0)
  with pytest.raises(ValueError, match="different training data"):
    changed.restore(stream.state())


def test_modes_mix_by_weight_and_generated_rows_continue_prompts():
  config = ModelConfig(arch="llama", vocab_size=91, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                       d_ff=48)
  params = init_params(config, jax.random.key(0))
  packed = data.pack([corpus.Document("a", "the quick brown fox jumps over the lazy dog " * 3)], encode, 16, 0)
  stream = data.BatchStream(packed, batch_size=2, seed=0)
  target_params = jax.tree.map(lambda p: -p, params)  # a different model of the same shape
  how = data.Continuation(prompt_len=5, eos_ids=(0,), sampling=sampling_params(1.0))
  batches = data.DistillBatches(stream, {"fixed": 1.0, "target": 1.0, "student": 2.0}, seed=1, how=how,
                                target_config=config, target_params=target_params, student_config=config)
  modes = [batches.mode(i) for i in range(400)]
  assert 0.4 < modes.count("student") / 400 < 0.6 and 0.17 < modes.count("target") / 400 < 0.33
  for mode, mode_params in (("target", target_params), ("student", params)):
    index = modes.index(mode)
    stream.position = index
    tokens, mask, got_mode = batches.next(params, jax.random.key(7))
    assert got_mode == mode and stream.position == index + 1
    prompt_tokens, prompt_mask = stream.batch(index)
    np.testing.assert_array_equal(tokens[:, :5], prompt_tokens[:, :5])
    assert not mask[:, :4].any() and mask[:, 4].all()
    want, _ = data.continue_rows(config, mode_params, prompt_tokens, prompt_mask, how,
                                 jax.random.key(7))  # the mode's model and key
    np.testing.assert_array_equal(tokens, want)
  with pytest.raises(ValueError, match="unknown generation mode"):
    data.DistillBatches(stream, {"teacher": 1.0}, 0, how, config, params, config)
