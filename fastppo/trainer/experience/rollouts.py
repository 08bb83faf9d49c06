"""An iteration's rollouts: the next prompts of the epoch order, sampled on the live weights, cut at
the stop strings and scored, with DAPO's dynamic sampling when asked.

Every rank reads the same global batch of the epoch order and rolls out its own share of it, so
the cursor (the trainer state's ``prompts_drawn``) is the same on every rank. With ``--rollout-tp``
the ranks of a rollout group decode their shares together, over a copy split between them
(``modeling/rollout_tp.py``), and each keeps its own share's rows. Dynamic sampling
(``filter_groups``) keeps the groups whose scores differ, since a group of equal scores has zero
advantage under every group estimator and teaches nothing, and samples further batches until
the ranks all have enough (they agree by an all-reduce, so their cursors stay together), at
most ``filter_groups_attempts`` batches; a batch still short is filled with equal groups.

With tools (an :class:`~fastppo.agents.Agent`) every row is an episode: its environment is reset
with its fields, the sampler runs its turns, and the rewards read its messages (a chat prompt's
completion is the episode's assistant and tool messages, as TRL passes them; a string prompt's
is the episode's text) and, with an environment, each row's instance (``environments``).

With ``max_staleness`` the batches go through one stream that never drains (``streaming.py``).
"""

from collections import deque
from typing import TYPE_CHECKING, Optional

import torch

from ...agents.episodes import episode_metrics
from ...errors import UsageError
from ...limits import GiB
from ...rollout import Sampler
from ...rollout.paged import KVMemoryError
from ..prompts.order import EpochOrder
from . import responses
from .sampled import Sampled, Scored
from .streaming import Streaming, decode_metrics

if TYPE_CHECKING:  # for the annotations only
    from ..configuration.config import TrainConfig
    from ..parallel.distributed import Ranks


class Rollouts:
    """Samples on the live weights and scores: the sampler over the rollout copy of the weights,
    the rewards, and the training prompts in their epoch order."""

    def __init__(
        self,
        config: "TrainConfig",
        models,
        rewards,
        prompts,
        fields: list,
        ranks: "Ranks",
        longest_prompt: int,
        agent=None,
        kv_memory=None,
    ):
        """``fields``: the prompt columns every reward call gets; ``longest_prompt``: the most tokens of
        any prompt the sampler will see, training or held-out; ``agent``: the run's tools, if any;
        ``kv_memory``: the sampler's KV budget in bytes (``plan.kv_memory``)."""
        self.config, self.rewards, self.prompts, self.fields, self.ranks = config, rewards, prompts, fields, ranks
        self.tokenizer, self.weights, self.device = models.tokenizer, models.rollout_weights, models.device
        self.agent = agent
        self.sharded, self.longest_prompt, self.kv_memory = models.sharded, longest_prompt, kv_memory
        self.group = models.rollout_group
        self.sampler = self._sampler(config.rollout.rollout_weights)
        if self.sharded:  # its KV cache waits for the first rollout: start-up holds the shards alone
            self.sampler.sleep()
        self._held_out = None  # the held-out evaluation's own sampler, while the stream holds this one's cache
        self.order = EpochOrder(len(prompts), config.run.seed)
        self.waiting = deque()  # this rank's prompts of batches drawn before a resume, to sample again
        self.streaming = Streaming(self, config.rollout.max_staleness) if config.rollout.max_staleness else None

    def _sampler(self, weights: str, decoder: Optional[str] = None) -> Sampler:
        """The sampler of the rollout weights, with ``decoder`` (default: the run's). With ``"auto"`` on
        several ranks, rank 0's timing chooses the decoder every rank runs (one run, one decoder)."""
        decoder = decoder or self.config.rollout.rollout_decoder
        if self.group.size > 1:  # a split copy runs through its own modules
            decoder = "modules"
        # the sampler reads the model when it is built (its cache's shape, the faster decoder)
        with self.weights.whole() as model:
            if decoder != "auto" or self.ranks is None or self.ranks.world == 1:
                return self._built(model, weights, decoder)
            first = self.ranks.on_main(lambda: self._built(model, weights, "auto"))
            chosen = self.ranks.gather(None if first is None else first.decoder)[0]
            return first if first is not None else self._built(model, weights, chosen)

    def _built(self, model, weights: str, decoder: str) -> Sampler:
        r = self.config.rollout
        try:
            return Sampler(
                model,
                max_batch_size=self.config.sampler_slots * self.group.size,  # a group decodes its ranks' rows
                max_seq_len=self.longest_prompt + self.config.response_tokens,
                # a whole copy gathered from shards is freed after each rollout; a split one stays put
                cuda_graphs=not self.sharded or self.group.size > 1,
                kv_block_size=r.rollout_kv_block_size or None,
                kv_memory=self.kv_memory,
                # a sharded run's copy is whole only during the rollout; a packed one would stay
                weights="live" if self.sharded else weights,
                decoder=decoder,
            )
        except KVMemoryError as error:
            raise UsageError(_kv_memory_error(error, r.rollout_kv_memory)) from None
        except ValueError as error:  # a decoder asked for that cannot serve the model
            if str(error).startswith("decoder="):
                raise UsageError(f"--rollout-{error}") from None
            raise

    @property
    def held_out_sampler(self) -> Sampler:
        """The sampler of the held-out evaluation: the rollouts' own, or with rollouts streaming (whose
        rows in flight hold its cache) one of its own, decoding the rollout weights as they are."""
        if self.streaming is None:
            return self.sampler
        if self._held_out is None:
            # built by the ranks that evaluate, when they first do: the decoder the rollouts' took,
            # with no collective
            self._held_out = self._sampler("live", self.sampler.decoder)
        return self._held_out

    def sample(
        self, prompt_ids: list, temperature: float, n: int, seed: int, on_rows_ended=None, turns=None, sampler=None
    ):
        """The ``sampler``'s (default: the rollouts') rollout of ``n`` responses per prompt with the
        run's sampling options, cut at the ``--stop`` strings; episodes of ``turns``, if given. The
        rollout copy must be refreshed."""
        sampler = sampler or self.sampler
        try:
            rollout = sampler.generate(
                prompt_ids,
                temperature=temperature,
                num_samples_per_prompt=n,
                seed=seed,
                on_rows_ended=on_rows_ended,
                turns=turns,
                **self.sampling_options(),
            )
        except KVMemoryError as error:  # a prompt whose samples the cache could never hold at once
            raise self.refused(error) from None
        return responses.cut_at_stop_strings(rollout, self.tokenizer, self.config.rollout.stop)

    def refused(self, error: KVMemoryError) -> UsageError:
        """The one line for a KV budget too small for a prompt's samples, naming the option."""
        return UsageError(_kv_memory_error(error, self.config.rollout.rollout_kv_memory))

    def sampling_options(self) -> dict:
        """The run's options of every rollout, ``generate``'s and a stream's alike: the budget, the
        sampling filters, the stop and pad ids and the tool schedule."""
        r, t, tok = self.config.rollout, self.config.tools, self.tokenizer
        return dict(
            max_new_tokens=r.max_new_tokens,
            top_k=r.top_k,
            top_p=r.top_p,
            stop_token_ids=(tok.eos_token_id,),
            pad_token_id=tok.pad_token_id,
            tool_schedule=t.tool_schedule,
            tool_window=t.tool_window,
        )

    def prompted(self, prompts, chosen: list, n: int, pool: int = 0) -> tuple:
        """What the sampler gets for ``n`` rows of each row ``chosen`` of ``prompts``: ``(turns, texts,
        ids, per_prompt)``, the rows' episodes (None without tools; each row's environment reset with
        its row's fields from the instances of ``pool``, ``Agent.reset``), each row's prompt text,
        and the prompts' ids, ``per_prompt`` rows each: ``n``, or 1 where a reset's observation made
        each row's prompt its own."""
        texts, ids, per_prompt = prompts.row_texts(chosen, n), [prompts.ids[i] for i in chosen], n
        if self.agent is None:
            return None, texts, ids, per_prompt
        rows = [i for i in chosen for _ in range(n)]
        instances, observations = self.agent.reset(
            [prompts.rows[i] for i in rows], [prompts.origins[i] for i in rows], pool
        )
        if any(o is not None for o in observations):  # each row's prompt its own
            texts = [self._observed(prompts, i, o, text) for i, o, text in zip(rows, observations, texts)]
            ids, per_prompt = [self.tokenizer(t, add_special_tokens=False).input_ids for t in texts], 1
            longest, room = max(map(len, ids)), self.sampler.max_seq_len - self.config.rollout.max_new_tokens
            if longest > room:
                raise UsageError(
                    f"{self.agent.environment.what}: a prompt with reset's observation is {longest} "
                    f"tokens, more than the {room} the sampler has room for"
                )
        return self.agent.episodes(instances), texts, ids, per_prompt

    def roll(
        self, prompts, chosen: list, temperature: float, n: int, seed: int, on_rows_ended=None, held_out=False
    ) -> Sampled:
        """``n`` responses to each row ``chosen`` of ``prompts`` (:meth:`sample`); with tools, episodes
        whose environments are reset with their rows' fields. ``held_out``: by the held-out sampler."""
        sampler = self.held_out_sampler if held_out else self.sampler
        turns, texts, ids, per_prompt = self.prompted(prompts, chosen, n)
        rollout = self.sample(ids, temperature, per_prompt, seed, on_rows_ended, turns, sampler)
        if turns is None:
            return Sampled(rollout, texts)
        return Sampled(rollout, texts, turns.rows, sampler.tool_wait_seconds)

    def _observed(self, prompts, i: int, observation, text: str) -> str:
        """Row ``i``'s prompt with ``observation`` (an environment's reset) added to its last message."""
        if observation is None:
            return text
        messages = prompts.messages[i]
        if messages is None:
            raise UsageError(
                f"{self.agent.environment.what}: reset returned an observation, which is added to the "
                f"prompt's last message, and {prompts.origins[i]} is a string prompt (give chat prompts, or --chat)"
            )
        last = messages[-1]
        observed = messages[:-1] + [{**last, "content": last["content"] + observation}]
        return self.agent.template.render(observed, True, self.agent.schemas_of(prompts.rows[i], prompts.origins[i]))

    def score(self, prompts, chosen: list, sampled: Sampled, n: int) -> tuple:
        """``(scores, each)`` of ``sampled``, ``n`` responses to each row ``chosen`` of ``prompts``: the
        rewards' weighted sum per response, and ``{name: scores}`` of each reward function."""
        rows = [i for i in chosen for _ in range(n)]
        fields = {k: [prompts.fields[i].get(k) for i in rows] for k in self.fields}
        completions = responses.completions(sampled.rollout, self.tokenizer)
        if sampled.episodes is not None:
            completions = [
                text if prompts.messages[i] is None else [dict(m) for m in episode.messages]
                for i, text, episode in zip(rows, completions, sampled.episodes)
            ]
            if self.agent.environment is not None:
                fields["environments"] = [episode.environment for episode in sampled.episodes]
        return self.rewards(sampled.texts, completions, fields)

    def next_batch(self, iteration: int, state) -> Scored:
        """This iteration's batch, drawn from ``state.prompts_drawn`` on (which it moves on); with
        ``filter_groups``, only groups whose scores differ."""
        self.weights.refresh()  # the sampler's copy catches up with the optimizer steps, once
        try:
            if self.streaming is not None:
                return self.streaming.next_batch(iteration, state)
            if self.config.rollout.filter_groups:
                return self._filtered(iteration, state)
            return self._scored_batch(iteration, state, 0)
        finally:
            self.rest()

    def rest(self) -> None:
        """After a rollout or an evaluation, a sharded run's update gets back the memory only a
        rollout uses: the rollout copy's (gathered whole or split, ``--rollout-tp``) and the samplers'
        KV caches (but a stream's, whose rows are in flight). A run on one device keeps its cache,
        and so its CUDA graphs: its update has the memory a model on one device leaves."""
        self.weights.release()
        if not self.sharded:
            return
        if self.streaming is None:
            self.sampler.sleep()
        if self._held_out is not None:
            self._held_out.sleep()

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
        episodes = None if batches[0].episodes is None else [s.episodes[i] for s, i in rows]
        stats = {
            "groups_informative": min(len(informative), wanted) / wanted,
            "sampling_attempts": float(len(batches)),
            "reward_sampled": float(torch.cat([b.raw for b in batches]).mean()),
            **({} if episodes is None else episode_metrics(episodes)),
            **({} if episodes is None else {"time_tools_wait": sum(b.stats["time_tools_wait"] for b in batches)}),
        }  # every row, kept or not
        gathered = responses.gather_rows([(s.rollout, i) for s, i in rows])
        return Scored(gathered, **picked, each_reward=each, stats=stats, episodes=episodes)

    def _scored_batch(self, iteration: int, state, attempt: int) -> Scored:
        """The next batch of prompts in the epoch order, sampled out and scored."""
        c, n, group = self.config, self.config.rollout.samples_per_prompt, self.group
        together = self.draw(state)
        seed = (c.run.seed * 100_003 + iteration) * self.ranks.world + group.first + attempt * 1_000_000_007
        sampled = self.roll(self.prompts, together, c.rollout.temperature, n, seed)
        s = self.sampler
        stats = decode_metrics(s.steps, s.live_rows, s.sparse_steps)
        if group.size == 1:
            return self.scored(together, sampled, stats)
        per_rank = len(together) // group.size  # this rank's share of the group's prompts, and their rows
        rows = range(group.member * per_rank * n, (group.member + 1) * per_rank * n)
        mine = Sampled(
            responses.gather_rows([(sampled.rollout, i) for i in rows]), sampled.texts[rows.start : rows.stop]
        )
        return self.scored(together[group.member * per_rank : (group.member + 1) * per_rank], mine, stats)

    def draw(self, state) -> list:
        """This rank's rollout group's share of the next global batch of the epoch order (this rank's
        own; with ``--rollout-tp`` its group's ranks' shares, in rank order), ``state``'s cursor moved
        on (first, those of a checkpoint's batches in flight that are sampled again)."""
        if self.waiting:
            return self.waiting.popleft()
        ranks, per_rank, group = self.ranks, self.config.rollout.prompts_per_iteration, self.group
        chosen = self.order.take(state.prompts_drawn, per_rank * ranks.world)
        state.prompts_drawn += per_rank * ranks.world
        return chosen[group.first * per_rank : (group.first + group.size) * per_rank]

    def scored(self, chosen: list, sampled: Sampled, stats: dict) -> Scored:
        """``sampled``, the responses to the training prompts ``chosen``, scored; ``stats`` the
        sampler's, for the logs."""
        c = self.config
        r, n = c.rollout, c.rollout.samples_per_prompt
        raw, each = self.score(self.prompts, chosen, sampled, n)
        raw = torch.tensor(raw, device=self.device)
        rollout = sampled.rollout
        no_stop = torch.tensor([f == "length" for f in rollout.finish_reason], device=self.device)
        generated = rollout.response_mask.sum(dim=1).to(self.device)  # an episode's tool tokens aside
        overlong = responses.overlong_penalty(
            generated, r.max_new_tokens, c.reward.overlong_buffer, c.reward.overlong_penalty
        )
        return Scored(
            rollout,
            raw + r.no_stop_penalty * no_stop + overlong,
            raw,
            no_stop,
            {name: torch.tensor(values) for name, values in each.items()},
            stats={
                **stats,
                **({} if sampled.episodes is None else episode_metrics(sampled.episodes)),
                **({} if sampled.episodes is None else {"time_tools_wait": sampled.tool_wait}),
            },
            episodes=sampled.episodes,
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
                **({} if scored.episodes is None else {"messages": scored.episodes[i].messages}),
                "score": float(scored.scores[i]),
                **{name: None if v[i].isnan() else float(v[i]) for name, v in scored.each_reward.items()},
            }
            for i, text in zip(rows, texts)
        ]


def _kv_memory_error(error: KVMemoryError, given) -> str:
    """The one line for a KV budget too small, naming the option."""
    if given is not None:
        return f"--rollout-kv-memory {given:g} is too small: {given:g} GiB would {error.reason}"
    return (
        f"the KV cache gets what the memory plan leaves on the device, {error.memory / GiB:.3g} GiB, too "
        f"little: it would {error.reason}; give --rollout-kv-memory, or see --plan"
    )
