"""An iteration's rollouts: the next prompts of the epoch order, sampled on the live weights, cut at
the stop strings and scored, with DAPO's dynamic sampling when asked.

Every rank reads the same global batch of the epoch order and rolls out its own share of it, so
the cursor (the trainer state's ``prompts_drawn``) is the same on every rank. Dynamic sampling
(``filter_groups``) keeps the groups whose scores differ, since a group of equal scores has zero
advantage under every group estimator and teaches nothing, and samples further batches until
the ranks all have enough (they agree by an all-reduce, so their cursors stay together), at
most ``filter_groups_attempts`` batches; a batch still short is filled with equal groups.
"""

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ..rollout import Sampler
from . import data, responses


@dataclass
class Scored:
    """A rollout and its scores: ``raw`` the rewards' weighted sum, ``scores`` with the no-stop and
    overlong penalties added (what the advantages see); ``each_reward`` each function's scores,
    and ``stats`` what dynamic sampling did."""

    rollout: object
    scores: Tensor  # (B,) fp32
    raw: Tensor  # (B,)
    no_stop: Tensor  # (B,) bool: the response hit max_new_tokens
    each_reward: dict  # name -> (B,)
    stats: dict = dataclasses.field(default_factory=dict)


class Rollouts:
    """Samples on the live weights and scores: the sampler over the rollout copy of the weights,
    the rewards, and the training prompts in their epoch order."""

    def __init__(self, config, models, rewards, prompts, fields: list, ranks, longest_prompt: int):
        """``fields``: the prompt columns every reward call gets; ``longest_prompt``: the most tokens of
        any prompt the sampler will see, training or held-out."""
        self.config, self.rewards, self.prompts, self.fields, self.ranks = config, rewards, prompts, fields, ranks
        self.tokenizer, self.weights, self.device = models.tokenizer, models.rollout_weights, models.device
        self.sampler = Sampler(
            models.rollout_weights.model,
            max_batch_size=config.sampler_slots,
            max_seq_len=longest_prompt + config.rollout.max_new_tokens,
            cuda_graphs=not models.sharded,
        )
        self.order = data.EpochOrder(len(prompts), config.run.seed)

    def sample(self, prompt_ids: list, temperature: float, n: int, seed: int, on_rows_ended=None):
        """The sampler's rollout of ``n`` responses per prompt with the run's sampling options, cut at
        the ``--stop`` strings. The rollout copy must be refreshed."""
        r, tok = self.config.rollout, self.tokenizer
        rollout = self.sampler.generate(
            prompt_ids,
            max_new_tokens=r.max_new_tokens,
            temperature=temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            stop_token_ids=(tok.eos_token_id,),
            pad_token_id=tok.pad_token_id,
            num_samples_per_prompt=n,
            seed=seed,
            on_rows_ended=on_rows_ended,
        )
        return responses.cut_at_stop_strings(rollout, tok, r.stop)

    def score(self, prompts, chosen: list, rolled, n: int) -> tuple:
        """``(scores, each)`` of ``rolled``, ``n`` responses to each row ``chosen`` of ``prompts``: the
        rewards' weighted sum per response, and ``{name: scores}`` of each reward function."""
        texts = [prompts.texts[i] for i in chosen for _ in range(n)]
        fields = {k: [prompts.fields[i].get(k) for i in chosen for _ in range(n)] for k in self.fields}
        return self.rewards(texts, responses.completions(rolled, self.tokenizer), fields)

    def next_batch(self, iteration: int, state) -> Scored:
        """This iteration's batch, drawn from ``state.prompts_drawn`` on (which it moves on); with
        ``filter_groups``, only groups whose scores differ."""
        self.weights.refresh()  # the sampler's copy catches up with the optimizer steps, once
        try:
            if self.config.rollout.filter_groups:
                return self._filtered(iteration, state)
            return self._scored_batch(iteration, state, 0)
        finally:
            self.weights.release()  # a gathered copy gives its memory back to the update

    def _filtered(self, iteration: int, state) -> Scored:
        """Batches until every rank holds ``prompts_per_iteration`` groups whose scores differ."""
        r = self.config.rollout
        n, wanted = r.samples_per_prompt, r.prompts_per_iteration
        batches, informative, equal = [], [], []  # (batch, group) pairs
        while True:
            batches.append(self._scored_batch(iteration, state, len(batches)))
            groups = batches[-1].scores.view(-1, n)  # (prompts, n)
            for g, same in enumerate((groups == groups[:, :1]).all(dim=1).tolist()):
                (equal if same else informative).append((len(batches) - 1, g))
            short = torch.tensor(float(len(informative) < wanted), device=self.ranks.device())
            if len(batches) == r.filter_groups_attempts or not bool(self.ranks.sum(short)):  # every rank agrees
                break
        rows = [(batches[b], g * n + j) for b, g in (informative + equal)[:wanted] for j in range(n)]
        picked = {name: torch.stack([getattr(s, name)[i] for s, i in rows]) for name in ("scores", "raw", "no_stop")}
        each = {k: torch.stack([s.each_reward[k][i] for s, i in rows]) for k in batches[0].each_reward}
        stats = {
            "groups_informative": min(len(informative), wanted) / wanted,
            "sampling_attempts": float(len(batches)),
            "reward_sampled": float(torch.cat([b.raw for b in batches]).mean()),
        }  # every row, kept or not
        return Scored(responses.gather_rows([(s.rollout, i) for s, i in rows]), **picked, each_reward=each, stats=stats)

    def _scored_batch(self, iteration: int, state, attempt: int) -> Scored:
        """The next batch of prompts in the epoch order, rolled out and scored."""
        c = self.config
        r, ranks = c.rollout, self.ranks
        world, rank, per_rank, n = ranks.world, ranks.rank, r.prompts_per_iteration, r.samples_per_prompt
        chosen = self.order.take(state.prompts_drawn, per_rank * world)[rank * per_rank : (rank + 1) * per_rank]
        state.prompts_drawn += per_rank * world
        rolled = self.sample(
            [self.prompts.ids[i] for i in chosen],
            r.temperature,
            n,
            seed=(c.run.seed * 100_003 + iteration) * world + rank + attempt * 1_000_000_007,
        )
        raw, each = self.score(self.prompts, chosen, rolled, n)
        raw = torch.tensor(raw, device=self.device)
        no_stop = torch.tensor([f == "length" for f in rolled.finish_reason], device=self.device)
        overlong = responses.overlong_penalty(
            rolled.response_lens.to(self.device), r.max_new_tokens, c.reward.overlong_buffer, c.reward.overlong_penalty
        )
        return Scored(
            rolled,
            raw + r.no_stop_penalty * no_stop + overlong,
            raw,
            no_stop,
            {name: torch.tensor(values) for name, values in each.items()},
        )

    def examples(self, scored: Scored, k: int) -> list:
        """The first ``k`` rows of ``scored`` as text, to read what the policy writes: the prompt as
        the sampler saw it, the completion, its score and each reward function's."""
        rows = range(min(k, len(scored.rollout.prompt_ids)))
        texts = responses.completions(scored.rollout, self.tokenizer, rows)
        return [
            {
                "prompt": self.tokenizer.decode(scored.rollout.prompt_ids[i]),
                "completion": text,
                "score": float(scored.scores[i]),
                **{name: float(v[i]) for name, v in scored.each_reward.items()},
            }
            for i, text in zip(rows, texts)
        ]
