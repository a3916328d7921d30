"""The adaptive policy's cost tables stored per machine and program (`specjax/speculative/k_policy/cost_store.py`):
measured once, reused by later runs of the same program (with the acceptance its calibration observed),
measured again for another program, on request, or when the stored file is damaged."""

import json
import os

import numpy as np
import pytest

from specjax import pipeline
from specjax.session import Session
from specjax.speculative import k_policy
from specjax.speculative.k_policy import Candidate, cost_store
from tests.helpers.cli import cli_config
from tests.helpers.cli import model_dirs  # noqa: F401 (the fixture)

PROMPTS = ["def add(a, b):", "hello"]


def test_a_measured_cost_table_is_stored_and_reused_by_a_later_run(model_dirs, monkeypatch):
  calibrations = []
  calibrate = Session.calibrate
  monkeypatch.setattr(Session, "calibrate",
                      lambda self, *args: calibrations.append(self.cache_len) or calibrate(self, *args))

  def run(**fields):
    logs = []
    config = cli_config(model_dirs, k_policy="adaptive", k=2, prompts=PROMPTS, **fields)
    return pipeline.run(config, log=logs.append)["stats"]["k_policy"], logs

  first, _ = run()
  (first_len,) = calibrations
  assert first["calibration_time_s"] > 0
  assert first["cost_table_measured_at"] is None
  (stored,) = os.listdir(cost_store.directory())
  with open(os.path.join(cost_store.directory(), stored)) as f:
    record = json.load(f)
  assert record["cost_table_s"] == first["cost_table_s"] and record["lengths"] == [0, 1, 2]
  assert record["description"]["machine"]["jax"] and record["description"]["cache_len"] == first_len
  # Calibration's forced rounds reached position 1 in every proposing round: their counts are stored.
  assert record["calibration_reached"][0][0] > 0 and np.shape(record["calibration_accepted"]) == (1, 2)

  # A later run of the same program (a new decoder: nothing in memory) reads it and measures nothing.
  again, logs = run(seed=3, temperature=0.0)
  assert calibrations == [first_len] and again["calibration_time_s"] == 0
  assert again["cost_table_s"] == first["cost_table_s"]
  assert again["cost_table_measured_at"] == record["measured_at"]
  # ... and starts from the acceptance prior its calibration left, not from adaptive.prior.
  assert again["acceptance_prior"] == pytest.approx(first["acceptance_prior"])
  assert first["acceptance_prior"] != pytest.approx([0.8, 0.8])
  assert any("reusing the round costs this machine measured for this program" in m for m in logs)

  # Asked to, it measures again and replaces the table.
  remeasured, _ = run(**{"adaptive.reuse_costs": False})
  assert len(calibrations) == 2 and remeasured["cost_table_measured_at"] is None
  assert os.listdir(cost_store.directory()) == [stored]

  # Another program (a longer budget: another cache length) has a table of its own.
  run(max_new_tokens=70)
  assert len(calibrations) == 3 and calibrations[-1] != first_len
  assert len(os.listdir(cost_store.directory())) == 2

  # A damaged file is named, not used, and replaced.
  with open(os.path.join(cost_store.directory(), stored), "w") as f:
    f.write('{"cost_table_s": [1.0')
  damaged, logs = run()
  assert len(calibrations) == 4 and damaged["calibration_time_s"] > 0
  assert any(
      m.startswith(f"ignoring the stored cost table {os.path.join(cost_store.directory(), stored)}") for m in logs)
  assert run()[0]["cost_table_measured_at"] is not None and len(calibrations) == 4


CHAIN = tuple(map(Candidate, (0, 1, 2)))
TREE = (Candidate(0), Candidate(1, True), Candidate(1), Candidate(2, True), Candidate(2))


def test_a_table_of_another_program_or_machine_is_not_found():
  """The file is named by the whole description: a different machine or setting misses; a file that
  answers to the name but describes another program (a hash collision, a hand-edited file) is refused."""
  description = {"machine": cost_store.machine(), "config": {"k": 2}, "cache_len": 128}
  cost_store.save(description, CHAIN, [0.1, 0.2, 0.3], 1.0, np.array([[9.0, 4.0]]), np.array([[6.0, 1.0]]))
  stored, note = cost_store.load(description, CHAIN, (1, 2))
  np.testing.assert_allclose(stored.cost_C, [0.1, 0.2, 0.3], rtol=1e-6)
  np.testing.assert_array_equal(stored.reached_AxK, [[9, 4]])
  np.testing.assert_array_equal(stored.accepted_AxK, [[6, 1]])
  assert stored.measured_at and note == ""
  elsewhere = {**description, "machine": {**description["machine"], "host": "elsewhere"}}
  assert cost_store.load(elsewhere, CHAIN, (1, 2)) == (None, "")
  assert cost_store.load({**description, "cache_len": 192}, CHAIN, (1, 2)) == (None, "")
  for candidates, shape in ((CHAIN + (Candidate(3),), (1, 2)), (CHAIN, (1, 3)), (TREE[:3], (1, 2))):
    stored, why = cost_store.load(description, candidates, shape)
    assert stored is None and "describes another program or holds no valid table" in why


def test_a_tree_table_keeps_its_spine_candidates_and_both_estimates_counts():
  description = {"machine": cost_store.machine(), "config": {"k": 2, "tree": "(2, 1)"}, "cache_len": 128}
  reached_AxK, accepted_AxK = np.array([[9.0, 4.0], [7.0, 3.0]]), np.array([[6.0, 1.0], [5.0, 0.0]])
  cost_store.save(description, TREE, [0.1, 0.2, 0.3, 0.3, 0.4], 1.0, reached_AxK, accepted_AxK)
  stored, _ = cost_store.load(description, TREE, (2, 2))
  np.testing.assert_array_equal(stored.reached_AxK, reached_AxK)
  np.testing.assert_array_equal(stored.accepted_AxK, accepted_AxK)
  # The same lengths without the spine flags (or with them elsewhere) are another table.
  for candidates in (tuple(Candidate(c.length) for c in TREE), TREE[:1] + (TREE[2], TREE[1]) + TREE[3:]):
    assert cost_store.load(description, candidates, (2, 2))[0] is None


def test_a_table_stored_before_the_acceptance_counts_loads_with_none_observed():
  """A file without counts (and one from before spines: no "spine" field) still loads for a chain."""
  description = {"machine": cost_store.machine(), "config": {"k": 2}, "cache_len": 64}
  path = cost_store.save(description, CHAIN, [0.1, 0.2, 0.3], 1.0, np.zeros((1, 2)), np.zeros((1, 2)))
  with open(path) as f:
    record = json.load(f)
  del record["calibration_reached"], record["calibration_accepted"], record["spine"]
  with open(path, "w") as f:
    json.dump(record, f)
  stored, _ = cost_store.load(description, CHAIN, (1, 2))
  np.testing.assert_array_equal(stored.reached_AxK, [[0, 0]])
  np.testing.assert_array_equal(stored.accepted_AxK, [[0, 0]])
  record.update(calibration_reached=[4.0, 2.0], calibration_accepted=[3.0, 1.0])  # counts of [K], as then
  with open(path, "w") as f:
    json.dump(record, f)
  np.testing.assert_array_equal(cost_store.load(description, CHAIN, (1, 2))[0].reached_AxK, [[4, 2]])


def test_a_stored_table_that_misses_a_call_is_measured_again_and_the_profile_accounts_for_the_calls(
    model_dirs, monkeypatch):
  """The cost table is held against every call (`Memory.check`): a stored table made 1000x too dear misses
  the next run's first call by far more than MISS_LIMIT, so that run measures it again before its next
  batch, replaces the stored one, and its stats say so (the check's floor MIN_CHECKED_S lowered: tiny
  models' calls last milliseconds). The first run profiled (`config.profile`): the rounds and draft
  passes the profile counts are the run's, and its prefill, first rounds and later rounds make up its
  calls."""
  def run(**fields):
    config = cli_config(model_dirs, k_policy="adaptive", k=2, prompts=PROMPTS * 2, batch_size=2, **fields)
    return pipeline.run(config, log=lambda message: None)["stats"]

  first = run(profile=True)
  assert first["k_policy"]["cost_checks"] == []  # calls under MIN_CHECKED_S: not checked
  profile = first["profile"]
  assert profile["rounds"] == first["target_calls"] - 2 and profile["calls"] == 2  # two batches: a prefill pass each
  later = profile["rounds"] - profile["calls"]  # each call's first round is set apart
  # The first rounds' draft passes (the prompts' catch-up among them) are not the later rounds'.
  assert 0 <= profile["draft_passes_per_round"] * later <= first["draft_calls"]
  assert 0 < profile["prefill_s"] < profile["calls_s"] and profile["passes_s"] > 0
  assert (profile["prefill_s"] + profile["calls"] * profile["first_round_s"] +
          later * profile["round_s"] == pytest.approx(profile["calls_s"]))
  assert profile["passes_s"] == pytest.approx(profile["verify_pass_s"] + profile["draft_passes_s"])
  # The priced table: each length's passes timed alone plus one overhead (a plain round's passes: the
  # 1-token target pass alone), made nondecreasing.
  priced = first["k_policy"]
  assert np.allclose(np.maximum.accumulate(np.add(priced["passes_s"], priced["round_overhead_s"])),
                     priced["cost_table_s"], rtol=1e-5)
  assert priced["passes_s"][0] < priced["passes_s"][-1]  # the longest runs draft passes and a wider verify

  (stored,) = os.listdir(cost_store.directory())
  path = os.path.join(cost_store.directory(), stored)
  with open(path) as f:
    record = json.load(f)
  record["cost_table_s"] = [1000 * c for c in record["cost_table_s"]]  # a wrong table
  with open(path, "w") as f:
    json.dump(record, f)
  monkeypatch.setattr(k_policy.tuning, "MIN_CHECKED_S", 0.0)
  second = run(seed=1)
  first_check = second["k_policy"]["cost_checks"][0]
  assert first_check["stale"] and first_check["miss"] < -0.5  # predicted far more than it took
  assert second["k_policy"]["remeasured_after_a_miss"] and second["k_policy"]["calibration_time_s"] > 0
  with open(path) as f:
    assert json.load(f)["cost_table_s"] == second["k_policy"]["cost_table_s"]  # the stored one replaced
