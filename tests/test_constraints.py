"""Constrained decoding: the host's token tables against an independent oracle (the `regex` module's
partial matching), and the engine under a constraint: greedy output equal to a reference that masks with
the oracle token by token (autoregressive, model and n-gram drafters, rows with different constraints),
outputs that always match at T = 1, and the first tokens' distribution against the masked, renormalised
target enumerated exactly, with the mutants it must reject."""

import json
import random
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest
import jsonschema
import regex

import specjax
from specjax import autoregressive, testing
from specjax.constraints import compiler
from specjax.constraints.mask import Constrained, Unconstrained
from specjax.errors import ConfigError
from specjax.generation import as_token_lists
from specjax.models.kv_cache import init_cache
from specjax.sampling import sampling_params
from specjax.speculative import acceptance, loop as loop_module
from specjax.speculative.drafters import model_shapes
from specjax.speculative.drafters.model import ModelDrafter
from specjax.speculative.drafters.layer_skip import LayerSkipDrafter
from specjax.speculative.drafters.ngram import NgramDrafter
from specjax.speculative.drafters.parallel import ParallelDrafter
from specjax.speculative.k_policy import Tables
from specjax.speculative.loop import SpeculativeLoop
from specjax.speculative.proposal import Proposal
from tests.helpers import engine, layer_skip
from tests.helpers.cli import cli_config, decode_in_process
from tests.helpers.cli import model_dirs  # noqa: F401 (the fixture)
from tests.helpers.constraints import (DIGITS_REGEX, EOS, OBJECT_REGEX, SMALL_REGEX, STRINGS_8, STRINGS_61,
                                       device_constraint, greedy_reference, oracle_mask, small_pvalue)
from tests.helpers.k_policy import COSTS_K3, POLICY

PROMPTS, BUDGETS = engine.PROMPTS, engine.BUDGETS
PATTERNS = [OBJECT_REGEX, DIGITS_REGEX]  # rows 0 and 2 under the first, row 1 under the second


@pytest.mark.parametrize("pattern, strings", [(OBJECT_REGEX, STRINGS_61), (DIGITS_REGEX, STRINGS_61),
                                              (SMALL_REGEX, STRINGS_8), ("a(xb)*", [b"", b"a", b"x", b"b"])])
def test_table_matches_the_oracle_along_random_walks(pattern, strings):
  """Along 100 random walks of allowed tokens, each state's allowed set is the oracle's (`a(xb)*`: the
  outlines-core bug `compile_table` works around, moves out of accepting states)."""
  table, rng = compiler.compile_table(pattern, strings, [EOS]), random.Random(0)
  for _ in range(100):
    state, text = 0, b""
    for _ in range(12):
      np.testing.assert_array_equal(table.next_ZxV[state] >= 0, oracle_mask(pattern, strings, text), err_msg=text)
      choices = [t for t in np.nonzero(table.next_ZxV[state] >= 0)[0] if t != EOS]
      if not choices:
        break
      token = rng.choice(choices)
      state, text = table.next_ZxV[state, token], text + strings[token]


def test_dead_ends_are_pruned_and_eos_only_accepts():
  """"ab|ac" over a vocabulary without "c": "a" may only be followed by "b"; EOS only after "ab"."""
  table = compiler.compile_table("ab|ac", [b"", b"a", b"b"], [EOS])
  assert list(table.next_ZxV[0] >= 0) == [False, True, False]
  after_a = table.next_ZxV[0, 1]
  assert list(table.next_ZxV[after_a] >= 0) == [False, False, True]
  assert list(table.next_ZxV[table.next_ZxV[after_a, 2]] >= 0) == [True, False, False]


def test_json_schema_spec_and_bad_input():
  schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
  assert regex.fullmatch(compiler.parse("json_schema:" + schema), '{"n": 12}')
  for spec, words in [("regex:(", r"config.constraint: invalid regular expression '\(': missing \), unterminated "
                       r"subpattern at position 0"),
                      ("regex:(?<=a)b", r"config.constraint: .* for '\(\?<=a\)b' \(outlines-core takes Rust's regex "
                       r"syntax: no lookaround"), ("regex:zz", "config.constraint"),
                      ("grammar:x", "config.constraint must start with"),
                      ('json_schema:{"type": 3}', "invalid JSON schema"),
                      ('json_schema:{"type": "object", "patternProperties": {"a": {}}}', "unsupported JSON schema"),
                      ("json_schema:/no/such/file.json", "neither inline JSON nor a file")]:
    with pytest.raises(ConfigError, match=words):
      compiler.compile_table(compiler.parse(spec), STRINGS_61, [EOS])


def test_stacked_tables_keep_each_rows_constraint():
  tables = [compiler.compile_table(p, STRINGS_61, [EOS]) for p in PATTERNS]
  next_ZxV, starts = compiler.stack(tables)
  assert list(starts) == [0, tables[0].num_states]
  np.testing.assert_array_equal(next_ZxV[starts[1]] >= 0, tables[1].next_ZxV[0] >= 0)


def _greedy_request():
  """PROMPTS greedy under PATTERNS (row by row), EOS on."""
  sampling = sampling_params(0.0).replace(constraint=device_constraint(PATTERNS, STRINGS_61, len(PROMPTS)))
  return testing.request(PROMPTS, BUDGETS, sampling, eos_ids=[EOS])


def _greedy_speculative(drafter, target=engine.TARGET, tables=Tables(), **settings):
  """(token lists, the output) of `drafter` at K = 3 on `_greedy_request`; `settings` the loop's."""
  config, params = target
  out = testing.speculate(SpeculativeLoop(config, 3, engine.OUT_WIDTH, **settings), params, drafter, _greedy_request(),
                          cache_len=engine.CACHE_LEN, tables=tables)
  return as_token_lists(out.tokens, out.counts), out


@pytest.fixture(scope="module")
def greedy_expected():
  return [
      greedy_reference(engine.TARGET, [p], [b], PATTERNS[i % 2], STRINGS_61)[0]
      for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))
  ]


def test_greedy_autoregressive_equals_the_reference(greedy_expected):
  config, params = engine.TARGET
  out = autoregressive.generate(config, params, _greedy_request(), init_cache(config, len(PROMPTS), engine.CACHE_LEN),
                                out_width=engine.OUT_WIDTH)
  assert as_token_lists(out.tokens, out.counts) == greedy_expected
  assert any(row[-1] == EOS for row in greedy_expected)  # some row finished its match


def test_greedy_model_drafter_equals_the_reference(greedy_expected):
  config, params = engine.DRAFTS["perturbed"]
  tokens, out = _greedy_speculative(ModelDrafter(config, params))
  assert tokens == greedy_expected
  assert int(out.acceptance.accepted.sum()) > 0


def test_greedy_model_drafter_under_the_adaptive_policy_equals_the_reference(greedy_expected):
  """A draft whose argmax is never the target's, under the adaptive policy (costs that make plain rounds
  and every length worth choosing): every proposed token rejected, the output still the reference."""
  config, params = engine.DRAFTS["never"]
  tokens, out = _greedy_speculative(ModelDrafter(config, params), policy=POLICY, tables=Tables(COSTS_K3))
  assert tokens == greedy_expected
  assert int(out.acceptance.proposed.sum()) > 0


def test_greedy_layer_skip_drafter_equals_the_reference():
  """A drafter drawing through `draft_chain` (layer skip; EAGLE's chain draws the same way)."""
  config, params = layer_skip.TARGET
  tokens, _ = _greedy_speculative(LayerSkipDrafter(config, params, layers=(0,)), target=layer_skip.TARGET)
  expected = [
      greedy_reference(layer_skip.TARGET, [p], [b], PATTERNS[i % 2], STRINGS_61)[0]
      for i, (p, b) in enumerate(zip(PROMPTS, BUDGETS))
  ]
  assert tokens == expected


def test_greedy_parallel_drafter_equals_the_reference(greedy_expected):
  """One pass proposes K tokens; position i is masked by the state after the draft's own d_1 .. d_{i-1}."""
  config, params = engine.DRAFTS["perturbed"]
  tokens, out = _greedy_speculative(ParallelDrafter(config, params, mask_id=engine.VOCAB - 1, k=3))
  assert tokens == greedy_expected
  assert int(out.acceptance.accepted.sum()) > 0


def test_greedy_ngram_drafter_equals_the_reference(greedy_expected):
  tokens, _ = _greedy_speculative(NgramDrafter(vocab_size=engine.VOCAB))
  assert tokens == greedy_expected


def test_a_lookup_proposal_is_cut_at_its_first_disallowed_token_and_a_sampled_one_is_not():
  """`SMALL_REGEX` from the start: "ab" then "c" allowed, "x" not; a sampled proposal is left whole (its
  rejection, by the masked target, keeps the rule exact; a cut would not)."""
  constraint = device_constraint([SMALL_REGEX], STRINGS_8, 2)
  point = Proposal(tokens=jnp.asarray([[4, 3, 7], [7, 3, 3]]), lengths=jnp.asarray([3, 2]))
  assert list(constraint.cut(point).lengths) == [2, 0]
  sampled = point.replace(probs=jnp.ones((2, 3, 8)) / 8)
  assert list(constraint.cut(sampled).lengths) == [3, 2]


# -- T = 1 on the 8-id model: the first SAMPLE_STEPS tokens against the exact constrained distribution -----
ROWS = 4_000  # the exact engine passes at ALPHA; each mutant below scores 0 at 1,000 rows (draws off the support)
ALPHA = 1e-4


def _sample(draft=engine.SMALL_DRAFT, rows=ROWS, k=3, rule=acceptance.verify):
  """(tokens [rows, SAMPLE_STEPS], the output) of the model drafter at T = 1 under SMALL_REGEX. A mutant
  passes a fresh `rule` (`_fresh`): a new static setting, so the program is traced with the patch in place."""
  (config, params), (draft_config, draft_params) = engine.SMALL_TARGET, draft
  drafter = ModelDrafter(draft_config, draft_params)
  sampling = sampling_params(1.0).replace(constraint=device_constraint([SMALL_REGEX], STRINGS_8, rows))
  request = testing.request([engine.SAMPLE_PROMPT] * rows, engine.SAMPLE_STEPS, sampling, seed=1, eos_ids=[EOS])
  out = testing.speculate(SpeculativeLoop(config, k, engine.SAMPLE_STEPS, rule=rule), params, drafter, request,
                          cache_len=16)
  return np.asarray(out.tokens), out


def test_sampled_model_drafter_follows_the_constrained_target():
  tokens, _ = _sample()
  assert small_pvalue(tokens) > ALPHA
  texts = {b"".join(STRINGS_8[t] for t in row if t != EOS).decode() for row in tokens}
  assert all(regex.fullmatch(SMALL_REGEX, text, partial=True) for text in texts)  # every row, T = 1


def test_sampled_autoregressive_follows_the_constrained_target():
  config, params = engine.SMALL_TARGET
  sampling = sampling_params(1.0).replace(constraint=device_constraint([SMALL_REGEX], STRINGS_8, ROWS))
  request = testing.request([engine.SAMPLE_PROMPT] * ROWS, engine.SAMPLE_STEPS + 1, sampling, seed=2, eos_ids=[EOS])
  out = autoregressive.generate(config, params, request, init_cache(config, ROWS, 16),
                                out_width=engine.SAMPLE_STEPS + 1)
  assert small_pvalue(np.asarray(out.tokens)[:, :engine.SAMPLE_STEPS]) > ALPHA


def _fresh():
  return lambda *args: acceptance.verify(*args)


def _unmasked(function):
  """`function(..., params)` (sampling params last) ignoring the params' constraint."""
  return lambda *args: function(*args[:-1], args[-1].replace(constraint=Unconstrained()))


def _shifted_along(self, tokens_BxK):
  """`Constrained.along` one token late: position i masked by the state before d_i, not after it."""
  states = [self.state, self.state]
  for i in range(tokens_BxK.shape[1] - 1):
    states.append(self.replace(state=states[-1]).advance(tokens_BxK[:, i]))
  return self.replace(state=jnp.stack(states, axis=1))


def test_mutants_are_rejected(monkeypatch):
  """Only the draft masked (the target's verify pass unmasked), and every position masked with the state
  one token late: both leave the constrained distribution."""
  with monkeypatch.context() as patch:
    patch.setattr(loop_module, "probabilities", _unmasked(loop_module.probabilities))
    tokens, _ = _sample(rows=1_000, rule=_fresh())
  assert small_pvalue(tokens) < 1e-12
  with monkeypatch.context() as patch:
    patch.setattr(Constrained, "along", _shifted_along)
    tokens, _ = _sample(rows=1_000, rule=_fresh())
  assert small_pvalue(tokens) < 1e-12


def test_a_draft_equal_to_the_target_is_always_accepted(monkeypatch):
  """Draft = target, both masked along the same states: q = p at every position, so every proposed
  token is accepted; a draft left unmasked (only the target masked: still exact, the rule rejects what
  the constraint forbids) loses tokens."""
  _, out = _sample(draft=engine.SMALL_TARGET, rows=300)
  assert int(out.acceptance.accepted.sum()) == int(out.acceptance.proposed.sum()) > 0
  with monkeypatch.context() as patch:
    patch.setattr(model_shapes, "tokens_and_probabilities", _unmasked(model_shapes.tokens_and_probabilities))
    _, out = _sample(draft=engine.SMALL_TARGET, rows=300, rule=_fresh())
  assert int(out.acceptance.accepted.sum()) < 0.95 * int(out.acceptance.proposed.sum())


# -- through specjax.Decoder: the tiny Qwen2 directories with the character tokenizer ------------------------
SCHEMA = '{"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["id"]}'

REGEX = "regex:[0-9]{3,8}"


@pytest.fixture(scope="module")
def decoder(model_dirs):
  """A Decoder over the tiny directories whose programs (batch 2, 24 tokens) the tests below share."""
  return specjax.Decoder(config=cli_config(model_dirs, max_new_tokens=24, batch_size=2))


def test_the_decoder_constrains_each_prompt_and_rejects_bad_input(decoder, tmp_path):
  """Through `specjax.Decoder`, a prompts file giving each prompt its own constraint (a JSON schema, a
  regex): the n-gram drafter's greedy output equals autoregressive decoding's under the same constraints,
  each output matches its own, a finished JSON one validates; bad `constraint` values fail in one line."""
  dec = decoder
  tok = dec.target.tokenizer
  constraints = ["json_schema:" + SCHEMA, REGEX]
  records = tmp_path / "prompts.jsonl"
  records.write_text("\n".join(
      json.dumps({"prompt": p, "constraint": c}) for p, c in zip(("abc", "hello"), constraints)))
  baseline = dec.run(prompts_file=str(records), mode="autoregressive")["outputs"]
  ngram = dec.run(prompts_file=str(records), drafter="ngram")["outputs"]
  assert [o["token_ids"] for o in ngram] == [o["token_ids"] for o in baseline]
  for output, constraint in zip(baseline, constraints):
    ids = output["token_ids"]
    finished = ids[-1] in tok.eos_ids
    text = tok.decode(ids[:-1] if finished else ids)
    assert regex.fullmatch(compiler.parse(constraint), text, partial=not finished)
    if finished and constraint.startswith("json_schema"):
      jsonschema.validate(json.loads(text), json.loads(SCHEMA))
  assert baseline[0]["token_ids"][-1] in tok.eos_ids  # the schema's row finished: a whole match
  out = dec.generate(("abc", "hello"), constraint=constraints, mode="autoregressive")
  assert out.token_ids == [o["token_ids"] for o in baseline]  # one constraint per prompt through the Python API
  # The texts drop special tokens (the EOS that ended the JSON row stays in its ids): the JSON reads as it is.
  jsonschema.validate(json.loads(out.texts[0]), json.loads(SCHEMA))
  assert out.texts == [tok.decode(ids, skip_special_tokens=True) for ids in out.token_ids]
  for fields, words in [({"constraint": "regex:(["}, "config.constraint"),
                        ({"constraint": "json_schema:{\"not\": {}}"}, "unsupported JSON schema keywords")]:
    with pytest.raises(ConfigError, match=words):
      dec.generate(["abc"], **fields)


def _no_temporary_files(monkeypatch):
  """Any temporary file or directory made from here on fails the test."""
  def refuse(*args, **kwargs):
    raise AssertionError("a temporary file was made")

  for name in ("mkstemp", "mkdtemp", "NamedTemporaryFile", "TemporaryDirectory", "TemporaryFile"):
    monkeypatch.setattr(tempfile, name, refuse)


def test_a_constraint_as_a_dict_or_in_a_request_decodes_as_its_string_and_writes_no_file(decoder, monkeypatch):
  """The issue's reproduction, `generate([p], constraint={"json_schema": {...}})`, and the dict regex,
  per prompt or inside a `specjax.Request`, give the tokens of the documented strings; no file is
  written for them."""
  _no_temporary_files(monkeypatch)
  schema, prompts = json.loads(SCHEMA), ("abc", "hello")
  strings = decoder.generate(prompts, constraint=["json_schema:" + SCHEMA, REGEX], mode="autoregressive").token_ids
  as_dicts = decoder.generate(prompts, constraint=[{"json_schema": schema}, {"regex": REGEX[len("regex:"):]}],
                              mode="autoregressive")
  assert as_dicts.token_ids == strings
  tok, ids = decoder.target.tokenizer, as_dicts.token_ids[0]
  assert ids[-1] in tok.eos_ids
  jsonschema.validate(json.loads(tok.decode(ids[:-1])), schema)  # the dict schema did constrain the output
  assert [o["constraint"] for o in as_dicts.results["outputs"]] == ["json_schema:" + json.dumps(schema), REGEX]
  # The call's constraint as a dict, and a request carrying its own (which wins over the call's).
  own = specjax.Request("hello", constraint={"regex": "[0-9]{3,8}"})
  assert decoder.generate(["abc", own], constraint={"json_schema": schema}, mode="autoregressive").token_ids == strings
  assert decoder.generate([specjax.Request("abc", {"json_schema": SCHEMA}), own],
                          mode="autoregressive").token_ids == strings


@pytest.mark.parametrize(
    "constraint, message",
    [
        ([None, "json_schema"
         ], "constraint of request 2 must start with one of regex:, json_schema:, got 'json_schema'"),
        ([None, {"json_schema": "json_schema"}
         ], "constraint of request 2: json_schema is neither inline JSON nor a file"),
        ([{"type": "json_schema", "json_schema": {}}, None
         ], "constraint of request 1 must be a dict with one key, 'regex' or 'json_schema', got keys"),
        ([None, {"regex": 3}], "constraint of request 2: regex must be a string, got 3"),
        ([None, {"json_schema": {"type": "object", "not": {}}}
         ], r"constraint of request 2: unsupported JSON schema keywords \['not'\]"),
        ([None, 7], "constraint of request 2 must be a string"),
        ([None, "regex:(["], "constraint of request 2: "),  # refused by the regex compiler, when the table is built
        ({"json_schema": {"type": "objekt"}}, "config.constraint: invalid JSON schema"),
        ({"regex": ["[0-9]"]}, "config.constraint: regex must be a string"),
        (["regex:a"], "constraint: 1 constraints for 2 prompts")
    ])
def test_a_bad_constraint_fails_in_one_line_naming_its_field_and_no_file(decoder, monkeypatch, constraint, message):
  _no_temporary_files(monkeypatch)
  with pytest.raises(ConfigError, match=message) as error:
    decoder.generate(["abc", "hello"], constraint=constraint, mode="autoregressive")
  assert "\n" not in str(error.value) and tempfile.gettempdir() not in str(error.value)


def test_a_request_checks_its_constraint_when_made():
  with pytest.raises(ConfigError, match="^constraint must be a dict with one key"):
    specjax.Request("x", constraint={"json_schema": {}, "regex": "a"})
  with pytest.raises(ConfigError, match="^prompt must be a string or a non-empty list of strings"):
    specjax.Request(["x", 3])
  assert specjax.Request("x", {"regex": "a+"}) == specjax.Request("x", "regex:a+")


def test_a_prompts_files_records_carry_dict_constraints_through_the_cli(decoder, model_dirs, tmp_path):
  """The command line's .jsonl prompts file parses into the same requests: a record's constraint as a
  dict or a string decodes as `Decoder.generate` does; a bad one fails with one line naming its line."""
  records, output = tmp_path / "prompts.jsonl", tmp_path / "out.json"
  records.write_text(
      json.dumps({"prompt": "abc", "constraint": {"json_schema": json.loads(SCHEMA)}}) + "\n" +
      json.dumps({"prompt": "hello", "constraint": REGEX}) + "\n")
  arguments = [
      "--config=configs/tiny.py", f"--config.target={model_dirs[0]}", f"--config.draft={model_dirs[1]}",
      "--config.max_new_tokens=24", "--config.batch_size=2", "--config.mode=autoregressive",
      f"--config.prompts_file={records}", f"--config.output={output}"
  ]
  status, stderr = decode_in_process(arguments)
  assert status == 0, stderr
  expected = decoder.generate(("abc", "hello"), constraint=["json_schema:" + SCHEMA, REGEX], mode="autoregressive")
  assert [o["token_ids"] for o in json.load(open(output))["outputs"]] == expected.token_ids
  records.write_text('{"prompt": "abc"}\n\n{"prompt": "hello", "constraint": {"regexp": "[0-9]+"}}\n')
  status, stderr = decode_in_process(arguments)
  assert status == 2 and stderr.strip() == (f"error: constraint of {records}:3 must be a dict with one key, 'regex' "
                                            f"or 'json_schema', got keys ['regexp']")


def test_greedy_output_equals_transformers_with_a_regex_logits_processor(model_dirs):
  """The reference built without specjax: transformers' greedy `generate` on the same tiny directory,
  with a logits processor that masks, token by token, what the `regex` module's partial matching allows
  after the text so far (an end-of-sequence id only after a whole match). specjax's autoregressive,
  model-drafted and n-gram decoding under the same constraint give its tokens, up to its end."""
  import torch
  import transformers

  pattern = r'\{"[a-e]{1,4}": ?(-?[0-9]{1,3}|"[a-e]{0,5}")\}'
  dec = specjax.Decoder(config=cli_config(model_dirs, max_new_tokens=24, batch_size=1))
  eos_ids = set(dec.target.tokenizer.eos_ids)
  hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{model_dirs[0]}/tokenizer.json")
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).eval()
  vocab = model.config.vocab_size
  special = {hf_tokenizer.convert_tokens_to_ids(name) for name in ("<unk>", "<eos>")}  # the tokenizer's two
  pieces = [hf_tokenizer.decode([v]) if v < len(hf_tokenizer) and v not in special else "" for v in range(vocab)]

  class RegexMask(transformers.LogitsProcessor):
    def __init__(self, prompt_len: int):
      self.prompt_len = prompt_len

    def __call__(self, input_ids, scores):
      text = "".join(pieces[v] for v in input_ids[0, self.prompt_len:].tolist())
      allowed = [
          regex.fullmatch(pattern, text) is not None
          if v in eos_ids else bool(pieces[v]) and regex.fullmatch(pattern, text + pieces[v], partial=True) is not None
          for v in range(scores.shape[1])
      ]
      return scores.masked_fill(~torch.tensor(allowed)[None], -float("inf"))

  ids = dec.target.tokenizer.encode("abc")
  with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=sorted(eos_ids),
                         pad_token_id=min(eos_ids),
                         logits_processor=transformers.LogitsProcessorList([RegexMask(len(ids))]))
  expected = out[0, len(ids):].tolist()
  if expected[-1] in eos_ids:  # generate pads after the end
    expected = expected[:expected.index(expected[-1]) + 1]
  assert len(expected) > 6 and regex.fullmatch(pattern, "".join(pieces[v] for v in expected if v not in eos_ids),
                                               partial=True)
  for fields in ({"mode": "autoregressive"}, {"drafter": "model"}, {"drafter": "ngram"}):
    assert dec.generate(["abc"], constraint="regex:" + pattern, **fields).token_ids == [expected], fields
