"""Speculative decoding: one `jax.jit` program, a ragged prefill of the target and the drafter, then a
`lax.while_loop` of rounds. Each round the drafter proposes up to K tokens per row, the target scores
[pending, d_1 .. d_K] in one pass (narrower when no live row proposes that many, see
`Drafter.verify_widths`), the acceptance rule keeps a prefix and draws the next token, and each row
advances by its own n + 1 tokens. Rows stop on their own (EOS or budget) and then stop changing; no
host round trip per round.

A drafter may propose a tree instead of a chain (`Proposal.verified_tree`: static, or one per row): the target
then scores all its nodes in one tree-masked pass (`_verify_tree_pass`, `tree_acceptance`), the
accepted path is compacted into contiguous cache slots, and the round continues with that path as the
proposal.

How many of the K tokens a round proposes is the K policy's choice (`k_policy`: all K, or adaptive,
0 included), made before the round's draft from earlier rounds only; the drafter gets it as the round's
plan (`plan`: the fixed policy's is a null plan) and the loop verifies no more: for a static tree, its
cut at that depth, or only that cut's spine (`k_policy.Candidate`).

Greedy rounds compare token ids (the target's argmaxes against the draft tokens, `verify_greedy`);
sampled rounds apply the acceptance rule to the processed distributions.

Static (changing them recompiles): the loop's settings (`SpeculativeLoop`: the model config, K, the
output width, the acceptance rules, the K policy), the drafter's static fields, the cache and storage
sizes (array shapes) and the sampling mode (greedy or sampled, top-k / top-p on or off:
`SamplingParams`' static flags). Runtime: the request (`generation.Request`: prompts, budgets, EOS ids,
the sampling knobs' values, keys, a round limit), the policy's tables (`k_policy.Tables`) and every array
of the drafter (a draft model's weights).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import generation, inplace, lowering, metrics
from specjax.models.config import ModelConfig
from specjax.models.kv_cache import KVCache
from specjax.models.transformer import Params, forward_features, hidden_to_logits, prefill, prefill_features
from specjax.sampling import SamplingParams, argmax_tokens, next_tokens, probabilities
from specjax.speculative import acceptance, k_policy
from specjax.speculative.drafters.base import Drafter
from specjax.speculative.k_policy import Candidate, KPolicy, Tables
from specjax.speculative.plan import RoundPlan
from specjax.speculative.proposal import Proposal
from specjax.speculative.trees import acceptance as tree_acceptance
from specjax.speculative.trees.tree import Tree, chain

AcceptanceRule = Callable[[jax.Array, Proposal, jax.Array], tuple[jax.Array, jax.Array]]
GreedyRule = Callable[[Proposal, jax.Array], tuple[jax.Array, jax.Array]]
TreeRule = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]  # `tree_acceptance.verify_tree`'s signature


@flax.struct.dataclass
class _LoopState:
  target_cache: KVCache  # [L, B, S, G, Dh] target cache: every committed token but the pending one
  draft_state: Any  # the drafter's state (e.g. ModelDraftState: draft cache and [B] flags)
  buffer: generation.OutputBuffer  # generated tokens [B, O], counts [B], done [B]
  pending: jax.Array  # [B] int32: newest committed token, not yet fed to the target
  key: jax.Array  # PRNG key, split once per round
  counts: metrics.AcceptanceCounts  # per-row acceptance counters: [B] and [B, K]
  draft_calls: jax.Array  # [] int32: draft forward passes so far (`Proposal.calls` summed)
  policy: k_policy.PolicyState  # acceptance estimates [B, A, K], the cost table [C], rounds per candidate [C]
  constraint: Any  # the rows' constraint after their pending tokens ([B] DFA states; the null one: nothing)


@flax.struct.dataclass
class SpeculativeOutput:
  tokens: jax.Array  # [B, out_width] int32, padded with pad_id after each row's count
  counts: jax.Array  # [B] int32: generated tokens per row (EOS included when hit)
  target_calls: jax.Array  # [] int32: target forward passes, prefill included (rounds + 1)
  draft_calls: jax.Array  # [] int32: draft forward passes proposing tokens (prompt prefill excluded)
  acceptance: metrics.AcceptanceCounts  # per-row rounds, proposed and accepted tokens, per position
  rounds_per_length: jax.Array  # [C] int32: rounds whose policy chose each of `KPolicy.candidates`
  policy_reached: jax.Array  # [A, K] float32: the policy's observations, rounds (summed over rows) that
  policy_accepted: jax.Array  # reached and accepted each position, per estimate (`k_policy.Memory`)
  target_cache: KVCache  # final caches, returned so the donated buffers can be reused
  draft_state: Any  # the drafter's final state (ModelDraftState.cache is the draft cache)


class _Round(NamedTuple):
  """What a round's verify pass checks: the pending tokens [B], the proposal, how to sample, its key."""

  pending_B: jax.Array
  proposal: Proposal
  sampling: SamplingParams
  key: jax.Array


def _spine_accepted(tree: Tree, path_BxDt1: jax.Array, num_accepted_B: jax.Array) -> jax.Array:
  """[B] int32: how many of the accepted path's nodes are first-choice children from the root on (what
  the spine's acceptance estimate observes of a round that verified the whole cut)."""
  first_BxDt = jnp.asarray(tree.is_first_child)[path_BxDt1[:, 1:]]
  accepted_BxDt = jnp.arange(tree.max_depth)[None, :] < num_accepted_B[:, None]
  return jnp.sum(jnp.cumprod(first_BxDt & accepted_BxDt, axis=1), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SpeculativeLoop:
  """The loop's static settings (hashable: a static argument of the jitted program; changing any
  recompiles). `rule` is the acceptance rule of sampled runs, replaceable for experiments (the tests
  inject broken ones to show the exactness tests can fail); `greedy_rule` the one of greedy runs, on
  token ids; `tree_rule` the tree rule (`tree_acceptance.verify_tree`'s signature)."""

  target_config: ModelConfig
  k: int  # the most draft tokens a round proposes (a tree's depth)
  out_width: int | None = None  # the output's width; None = the largest budget (`speculative_generate`)
  pad_id: int = 0
  policy: KPolicy = KPolicy()  # how many of the K tokens a round proposes
  rule: AcceptanceRule = acceptance.verify
  greedy_rule: GreedyRule = acceptance.verify_greedy
  tree_rule: TreeRule = tree_acceptance.verify_tree
  # The drafter's class, set by `speculative_generate`: two drafter classes with the same fields flatten
  # to pytree structures that compare equal (jax compares the nodes' static data, not their classes), so
  # without it a subclass (a researcher's variant, a test's mutant) could run its parent's program.
  drafter_class: type | None = None

  def widths(self, drafter: Drafter) -> tuple[int, ...]:
    """The verify widths a program compiles: the drafter's and the policy's candidate lengths + 1."""
    return tuple(sorted(set(drafter.verify_widths(self.k)) | set(self.policy.widths(self.k))))

  def _verify_pass(self, target_params: Params, width: int, features: tuple[int, ...], round_: _Round,
                   target_cache: KVCache):
    """Scores [pending, d_1 .. d_{width-1}] and applies the rule (`greedy_rule` on the target's argmaxes
    when greedy) to that many draft tokens per row.
    Returns (cache, (accepted [B], next token [B], the target's features [B, K + 1, F] zero-padded (the
    final-norm hidden states, or the residual streams after the blocks `features`: `forward_features`))):
    the form `inplace.switch` takes."""
    config, checked = self.target_config, round_.proposal.truncated(width - 1)
    # Position i's distribution is masked by the constraint's state after [pending, d_1 .. d_i].
    sampling = round_.sampling.replace(constraint=round_.sampling.constraint.along(checked.tokens))
    # A draft with a larger head may propose ids the target lacks: they are always rejected, so what the
    # target scores after them is never used, but it must embed something finite (`jnp.take` gives NaN
    # rows, which would stay in the cache beyond the committed length): its last id.
    fed_BxK = jnp.minimum(checked.tokens, config.vocab_size - 1)
    block_BxK1 = jnp.concatenate([round_.pending_B[:, None], fed_BxK], axis=1)
    hidden_BxK1xD, features_BxK1xF, target_cache = forward_features(config, target_params, block_BxK1, target_cache,
                                                                    features)
    logits_BxK1xV = hidden_to_logits(config, target_params, hidden_BxK1xD)
    if sampling.greedy:
      num_accepted_B, next_B = self.greedy_rule(checked, argmax_tokens(logits_BxK1xV, sampling))
    else:
      num_accepted_B, next_B = self.rule(round_.key, checked, probabilities(logits_BxK1xV, sampling))
    return target_cache, (num_accepted_B, next_B, jnp.pad(features_BxK1xF, ((0, 0), (0, self.k + 1 - width), (0, 0))))

  def _verify_tree_pass(self, target_params: Params, features: tuple[int, ...], round_: _Round, candidate: Candidate,
                        target_cache: KVCache):
    """Scores the tree [pending, nodes 1..N] (static: only what the round chose, `candidate`: its cut at
    a depth, `Tree.cut`, a prefix of the nodes, or that cut's spine, `Tree.spine`, a chain) in one
    tree-masked pass, applies the tree rule (greedy on the target's argmaxes) and compacts the accepted
    path's keys/values (not for a chain: statically free).
    Returns (cache, (accepted [B], next token [B], the target's features along the path [B, Dt + 1, F]
    (as `_verify_pass`), the accepted path [B, Dt + 1] (node indices of the whole tree: `Proposal.along`),
    both padded with its last node)): the form `inplace.switch` takes."""
    config, proposal = self.target_config, round_.proposal
    tree, full_depth = proposal.verified_tree, proposal.verified_tree.max_depth
    nodes = None  # the verified nodes' indices in the whole tree, when not a prefix of them
    if candidate.spine:
      nodes = np.asarray(tree.spine(candidate.length))
      tree, proposal = chain(len(nodes) - 1), proposal.picked(nodes[1:])
    elif candidate.length < full_depth:
      tree = tree.cut(candidate.length)
      proposal = proposal.truncated(tree.nodes_with_root - 1)
    fed_BxN = jnp.minimum(proposal.tokens, config.vocab_size - 1)  # as in `_verify_pass`
    block_BxN1 = jnp.concatenate([round_.pending_B[:, None], fed_BxN], axis=1)
    hidden_BxN1xD, features_BxN1xF, target_cache = forward_features(config, target_params, block_BxN1, target_cache,
                                                                    features, tree=tree)
    logits_BxN1xV = hidden_to_logits(config, target_params, hidden_BxN1xD)
    # Node i's distribution is masked by the constraint's state after its own root-to-node path.
    sampling = round_.sampling.replace(constraint=round_.sampling.constraint.along(proposal.tokens, tree))
    if sampling.greedy:
      path_BxDt1, num_accepted_B, next_B = tree_acceptance.verify_tree_greedy(tree, proposal.tokens,
                                                                              argmax_tokens(logits_BxN1xV, sampling))
    else:
      path_BxDt1, num_accepted_B, next_B = self.tree_rule(round_.key, tree, proposal.tokens, proposal.probs,
                                                          probabilities(logits_BxN1xV, sampling))
    if not tree.is_chain:
      target_cache = target_cache.compact(path_BxDt1)
    path_BxDt1 = jnp.pad(path_BxDt1, ((0, 0), (0, full_depth + 1 - path_BxDt1.shape[1])), mode="edge")
    features_BxDt1xF = jnp.take_along_axis(features_BxN1xF, path_BxDt1[:, :, None], axis=1)
    if nodes is not None:
      path_BxDt1 = jnp.asarray(nodes, jnp.int32)[path_BxDt1]
    return target_cache, (num_accepted_B, next_B, features_BxDt1xF, path_BxDt1)


def _prefill(config: ModelConfig, target_params: Params, drafter: Drafter, request: generation.Request,
             target_cache: KVCache, draft_storage: Any) -> tuple[jax.Array, KVCache, Any]:
  """Prefills the target with the prompts (whatever its cache held before) and starts the drafter's state:
  from the target's features of the prompts when the drafter reads them, else from the prompts and the
  target's cache. Returns the target's logits after each prompt [B, V], its cache and the draft state."""
  prompts_BxP, prompt_lengths_B = request.prompts_BxP, request.prompt_lengths_B
  target_cache = target_cache.replace(lengths=jnp.zeros((prompts_BxP.shape[0],), jnp.int32))
  if drafter.reads_prompt_features:  # a drafter reading the target's features of the prompts
    logits_BxV, features_BxPxF, target_cache = prefill_features(config, target_params, prompts_BxP, prompt_lengths_B,
                                                                target_cache, drafter.feature_layers)
    draft_state = drafter.init_from_features(draft_storage, prompts_BxP, prompt_lengths_B, features_BxPxF)
  else:
    logits_BxV, target_cache = prefill(config, target_params, prompts_BxP, prompt_lengths_B, target_cache)
    draft_state = drafter.init(draft_storage, prompts_BxP, prompt_lengths_B, target_cache)
  return logits_BxV, target_cache, draft_state


class _Drafted(NamedTuple):
  """A round's draft as the loop verifies it, and what the policy chose."""

  proposal: Proposal  # clipped to the plan, cut before the first token the constraint forbids
  draft_state: Any
  target_cache: KVCache  # as the drafter left it (a drafter may read and write the target's cache)
  choice: jax.Array  # [] int32: the chosen index of `KPolicy.candidates`
  own_B: jax.Array  # [B] int32: the drafter's own tokens in the proposal (what the policy observes)


class _Verified(NamedTuple):
  """A round's verify pass: what each row accepted and drew, and the target's features along it."""

  target_cache: KVCache
  num_accepted_B: jax.Array  # [B] int32
  next_B: jax.Array  # [B] int32: the token drawn after the accepted ones
  features_BxK1xF: jax.Array  # [B, K + 1, F]: the target's features (`forward_features`), zero- or edge-padded
  proposal: Proposal  # the round's proposal; a tree's accepted path (`Proposal.along`)
  path_BxDt1: jax.Array | None  # a tree's accepted path [B, Dt + 1] (node indices of the whole tree); None: a chain


class _Rounds(NamedTuple):
  """What every round of one program reads: the static settings, the target's weights, the drafter, the
  request and the K policy's candidates ([C] lengths and spine flags). `cond` and `body` are the
  `lax.while_loop`'s; a round drafts (`_draft`), verifies (`_verify`) and commits (`_advance`)."""

  loop: SpeculativeLoop
  target_params: Params
  drafter: Drafter
  request: generation.Request
  candidates: tuple[Candidate, ...]
  lengths_C: jax.Array
  spine_C: jax.Array

  @classmethod
  def of(cls, loop: SpeculativeLoop, target_params: Params, drafter: Drafter, request: generation.Request):
    candidates = loop.policy.candidates(loop.k, drafter.tree)
    return cls(loop, target_params, drafter, request, candidates, jnp.asarray([c.length for c in candidates]),
               jnp.asarray([c.spine for c in candidates]))

  def cond(self, state: _LoopState) -> jax.Array:
    return ~jnp.all(state.buffer.done) & (jnp.max(state.counts.rounds) < self.request.round_limit)

  def body(self, state: _LoopState) -> _LoopState:
    key, draft_key, accept_key = jax.random.split(state.key, 3)
    live_B = ~state.buffer.done
    drafting = self.request.sampling.replace(constraint=state.constraint)  # the draft masked like the target
    drafted = self._draft(state, live_B, drafting, draft_key)
    verified = self._verify(_Round(state.pending, drafted.proposal, drafting, accept_key), drafted, live_B)
    return self._advance(state, key, live_B, drafted, verified)

  def _draft(self, state: _LoopState, live_B: jax.Array, drafting: SamplingParams, draft_key: jax.Array) -> _Drafted:
    """The policy's plan and the drafter's proposal (a lookup drafter's first: the policy prices what each
    row offers), cut to what the round may verify."""
    policy, drafter = self.loop.policy, self.drafter
    draft = functools.partial(drafter.propose, state.draft_state, state.target_cache, state.pending, drafting,
                              draft_key)
    if drafter.free_proposal:  # a lookup first: the policy prices what each row offers
      proposal, draft_state, target_cache = draft(RoundPlan(self.loop.k))
      plan, choice = policy.choose(state.policy, live_B, self.candidates, proposal.lengths)
    else:
      plan, choice = policy.choose(state.policy, live_B, self.candidates)
      proposal, draft_state, target_cache = draft(plan)
    # What a drafter proposes beyond the plan is never verified, nor a lookup past a disallowed token.
    clipped_B = plan.clip(proposal.lengths)
    proposal = state.constraint.cut(
        proposal.replace(lengths=plan.extend(clipped_B) if proposal.point_masses else clipped_B))
    own_B = jnp.minimum(clipped_B, proposal.lengths)  # the drafter's own tokens: what the policy observes
    return _Drafted(proposal, draft_state, target_cache, choice, own_B)

  def _verify(self, round_: _Round, drafted: _Drafted, live_B: jax.Array) -> _Verified:
    """One target pass over the round's proposal: a tree's chosen candidate, or the narrowest chain width
    that checks every live row's whole proposal."""
    loop, features = self.loop, self.drafter.feature_layers
    proposal = round_.proposal
    longest = jnp.max(jnp.where(live_B, proposal.lengths, 0))
    if proposal.verified_tree is not None:  # K = the tree's depth; the accepted path becomes the proposal
      # The chosen candidate (one per round), cut at the longest live proposal, whatever narrow_passes
      # says: the drafter drew nothing deeper, so the cut is what the round may verify, not a saving.
      fits_C = (self.lengths_C >= longest) & ((self.spine_C == self.spine_C[drafted.choice]) | (self.lengths_C == 0))
      target_cache, (num_accepted_B, next_B, features_BxK1xF, path_BxDt1) = inplace.switch(
          jnp.argmax(fits_C),
          [functools.partial(loop._verify_tree_pass, self.target_params, features, round_, c) for c in self.candidates],
          drafted.target_cache)
      return _Verified(target_cache, num_accepted_B, next_B, features_BxK1xF, proposal.along(path_BxDt1), path_BxDt1)
    widths = loop.widths(self.drafter) if loop.target_config.narrow_passes else (loop.k + 1,)
    passes = [functools.partial(loop._verify_pass, self.target_params, width, features, round_) for width in widths]
    index = jnp.searchsorted(jnp.asarray(widths), longest + 1)
    target_cache, (num_accepted_B, next_B, features_BxK1xF) = inplace.switch(index, passes, drafted.target_cache)
    return _Verified(target_cache, num_accepted_B, next_B, features_BxK1xF, proposal, None)

  def _observed(self, drafted: _Drafted, verified: _Verified) -> tuple[jax.Array, jax.Array]:
    """What each acceptance estimate observed of the drafter's own tokens, proposed and accepted [A, B]:
    the whole cut's (a chain's) from the round's outcome, unless the round verified a spine; the spine's
    (a branching static tree under the adaptive policy) from the accepted path's first-choice prefix."""
    own_B = drafted.own_B
    own_accepted_B = jnp.minimum(verified.num_accepted_B, own_B)
    if not any(c.spine for c in self.candidates):
      return own_B[None], own_accepted_B[None]
    tree = self.drafter.tree
    whole_cut = ~self.spine_C[drafted.choice]
    proposed_AxB = jnp.stack([jnp.where(whole_cut, own_B, 0), jnp.minimum(own_B, len(tree.spine()) - 1)])
    return proposed_AxB, jnp.stack([
        jnp.where(whole_cut, own_accepted_B, 0),
        jnp.minimum(_spine_accepted(tree, verified.path_BxDt1, verified.num_accepted_B), own_B)
    ])

  def _advance(self, state: _LoopState, key: jax.Array, live_B: jax.Array, drafted: _Drafted,
               verified: _Verified) -> _LoopState:
    """Emits each row's accepted tokens and its drawn one, commits them to both caches (rows that just
    finished commit nothing) and updates the counters, the policy's estimates and the constraint."""
    proposed_AxB, accepted_AxB = self._observed(drafted, verified)
    proposal, num_accepted_B, next_B = verified.proposal, verified.num_accepted_B, verified.next_B
    request, k = self.request, self.loop.k
    # Emitted this round: d_1 .. d_n, then the drawn token at index n.
    emitted_BxK1 = jnp.where(
        jnp.arange(k + 1)[None, :] < num_accepted_B[:, None], jnp.pad(proposal.tokens, ((0, 0), (0, 1))), next_B[:,
                                                                                                                 None])
    buffer, kept_B = generation.append(state.buffer, emitted_BxK1, num_accepted_B + 1, request.eos_ids,
                                       request.max_new_tokens)
    # Rows that just finished commit nothing either: their caches stay where the capacity check counts.
    num_committed_B = jnp.where(buffer.done, 0, num_accepted_B + 1)
    return _LoopState(
        target_cache=verified.target_cache.advance(num_committed_B),
        draft_state=self.drafter.commit(drafted.draft_state, proposal, num_committed_B, verified.features_BxK1xF),
        buffer=buffer, pending=jnp.where(buffer.done, state.pending, next_B), key=key,
        counts=metrics.record(state.counts, num_accepted_B, proposal.lengths, live_B,
                              state.constraint.forced_count(emitted_BxK1,
                                                            kept_B)), draft_calls=state.draft_calls + proposal.calls,
        policy=self.loop.policy.update(state.policy, drafted.choice, proposed_AxB, accepted_AxB,
                                       live_B), constraint=state.constraint.after(emitted_BxK1, num_committed_B))


@functools.partial(jax.jit, static_argnames=("loop",), donate_argnames=("target_cache", "draft_storage"))
def _generate(loop: SpeculativeLoop, target_params: Params, drafter: Drafter, request: generation.Request,
              target_cache: KVCache, draft_storage: Any, tables: Tables) -> SpeculativeOutput:
  """The program: the prefill and the first token, then rounds (`_Rounds`) until every row is done."""
  k, sampling, batch = loop.k, request.sampling, request.prompts_BxP.shape[0]
  logits_BxV, target_cache, draft_state = _prefill(loop.target_config, target_params, drafter, request, target_cache,
                                                   draft_storage)
  key, first_key = jax.random.split(request.key)
  first_B = next_tokens(first_key, logits_BxV, sampling)
  # Room for a whole block of K + 1 tokens appended at a count of up to out_width - 1.
  buffer, first_kept_B = generation.append(generation.empty_buffer(batch, loop.out_width + k + 1), first_B[:, None],
                                           jnp.ones((batch,), jnp.int32), request.eos_ids, request.max_new_tokens)
  rounds = _Rounds.of(loop, target_params, drafter, request)
  state = jax.lax.while_loop(
      rounds.cond, rounds.body,
      _LoopState(
          target_cache=target_cache, draft_state=draft_state, buffer=buffer, pending=first_B, key=key,
          counts=metrics.zero_counts(batch,
                                     k).replace(forced=sampling.constraint.forced_count(first_B[:,
                                                                                                None], first_kept_B)),
          draft_calls=jnp.int32(0), policy=loop.policy.init(batch, rounds.candidates, tables),
          constraint=sampling.constraint.after(first_B[:, None], 1)))
  num_rounds = jnp.max(state.counts.rounds)  # a row is live in a prefix of the rounds; some row in each
  return SpeculativeOutput(tokens=generation.finalize(state.buffer, loop.pad_id)[:, :loop.out_width],
                           counts=state.buffer.counts, target_calls=num_rounds + 1, draft_calls=state.draft_calls,
                           acceptance=state.counts, rounds_per_length=state.policy.chosen_C,
                           policy_reached=state.policy.reached_AxK, policy_accepted=state.policy.accepted_AxK,
                           target_cache=state.target_cache, draft_state=state.draft_state)


def speculative_generate(loop: SpeculativeLoop, target_params: Params, drafter: Drafter, request: generation.Request,
                         target_cache: KVCache, draft_storage: Any, tables: Tables = Tables(),
                         lower: bool | str = False) -> SpeculativeOutput | jax.stages.Lowered:
  """Generates up to `request.max_new_tokens` (int, or one per row) after each prompt, with `drafter`
  proposing up to K tokens per round (`loop`: the static settings); the output is distributed exactly
  as the target's own sampling (equal to it token for token when greedy).

  `target_cache` comes from `init_cache` and `draft_storage` from `drafter.storage` (any contents;
  both are donated: use the ones returned, `target_cache` and `draft_state`). The target cache must
  hold the longest prompt + budget + K - 1 positions: a live row has emitted G <= budget - 1 tokens,
  so its cache holds at most prompt + G - 1 of them and its round writes the K + 1 block [pending,
  d_1 .. d_K] before the end; a finished row commits nothing in its last round and keeps rewriting the
  same uncommitted positions while others run. The drafter checks its own storage. `loop.out_width`
  (static; defaults to the largest budget) fixes the output shape so that calls with smaller budgets
  reuse the compiled program. Greedy and sampled runs are separate programs.

  A drafter with a static `tree` (a `tree.Tree` of N nodes and depth Dt; `ModelDrafter(tree=...)`)
  proposes trees: K must be Dt, each round verifies the N + 1 nodes in one tree-masked target pass
  (`tree_acceptance`, `loop.tree_rule`), compacts the accepted path in the target cache and commits it
  to the drafter as a chain. The target cache then needs N - 1 positions of slack instead of K - 1.
  With the adaptive policy a round verifies the tree cut at the chosen depth, or that cut's spine (one
  compiled tree pass per candidate); a dynamic tree needs the fixed policy.

  `loop.policy` (`k_policy.KPolicy`) decides how many of the K tokens a round proposes: all of them
  (fixed), or the candidate maximising expected committed tokens per second under `tables.cost_C` ([C]
  seconds per round at each of `policy.candidates(k, drafter.tree)`, measured by `k_policy.calibrate`;
  default all equal) and the per-position acceptance prior `tables.prior_AxK` ([A, K] in (0, 1), A =
  `policy.rows(k, drafter.tree)`, or [K] for every row: what earlier calls measured, `k_policy.Memory`;
  default `policy.prior` everywhere). `request.round_limit` (None = no limit) stops the loop after that
  many rounds, finished or not: what calibration times.

  `lower=True` returns the program lowered for these arguments instead of running it (its HLO, its
  collectives on a mesh, its compile time); `lower="cuda"` (any of `lowering.PLATFORMS`) lowers it for
  that platform, with no such device (`lowering.report`).
  """
  _check_drafter(loop, drafter)
  tables = loop.policy.tables(loop.k, drafter.tree, tables)
  budget_B, out_width = _check_fits(loop, drafter, request, target_cache, draft_storage)
  request = request.ready(budget_B)
  return lowering.call_or_lower(_generate, lower,
                                dataclasses.replace(loop, out_width=out_width, drafter_class=type(drafter)),
                                target_params, drafter, request, target_cache, draft_storage, tables)


def _check_drafter(loop: SpeculativeLoop, drafter: Drafter) -> None:
  """Raises ValueError unless K is an integer >= 1, the drafter fits the target, a tree's depth is K and the
  drafter's verify widths ascend to K + 1."""
  k = loop.k
  if int(k) != k or k < 1:
    raise ValueError(f"k (draft tokens per round) must be an integer >= 1, got {k}")
  drafter.check(loop.target_config)
  tree = drafter.tree
  if tree is not None and k != tree.max_depth:
    raise ValueError(f"k = {k}, but the drafter's tree has depth {tree.max_depth}: pass k = {tree.max_depth}")
  widths = drafter.verify_widths(k)
  if list(widths) != sorted(set(widths)) or widths[0] < 1 or widths[-1] != k + 1:
    raise ValueError(f"the drafter's verify widths {widths} must ascend from >= 1 to K + 1 = {k + 1}")


def _check_fits(loop: SpeculativeLoop, drafter: Drafter, request: generation.Request, target_cache: KVCache,
                draft_storage: Any) -> tuple[jax.Array, int]:
  """Raises ValueError unless the target cache has a row per prompt and both caches hold the longest prompt,
  its budget and a round's look-ahead. Returns the budgets [B] and the output width."""
  k, tree, batch = loop.k, drafter.tree, request.prompts_BxP.shape[0]
  if target_cache.batch_size != batch:
    raise ValueError(f"target cache has {target_cache.batch_size} rows for {batch} prompts")
  budget_B, out_width = generation.budgets(request.max_new_tokens, batch, loop.out_width)
  largest = int(jnp.max(budget_B))
  if tree is not None:
    tree.check_fits(target_cache.max_len, "target cache")
  generation.check_fits("speculative generate (target)", request.prompt_lengths_B, largest,
                        drafter.shape.cut_nodes(k) - 2, target_cache.max_len, loop.target_config.max_positions)
  drafter.check_fits(draft_storage, request.prompt_lengths_B, largest, k)
  return budget_B, out_width
