"""What the trainer does to sampled responses: stop strings, the text each reward function reads,
DAPO's soft overlong penalty, and gathering rows of several rollouts into one.

Stop strings end a response at the first token whose text completes one (the string stays in
the response, its mask ends there). The sampler stops on token ids only, so a row is cut after
sampling: the tokens past the stop were decoded for nothing, and the row reads as stopped.
Finding the cut is a binary search over decoded prefixes (a prefix that holds the string stays
holding it as it grows), ``log2(R)`` decodes per row that has the string rather than ``R``.
"""

import dataclasses

import torch


def completions(rollout, tokenizer, rows=None) -> list:
    """Each row's response (or those of ``rows``) as text, special tokens left out."""
    rows = range(len(rollout.response_lens)) if rows is None else rows
    return [
        tokenizer.decode(rollout.response_ids[i, : int(rollout.response_lens[i])].tolist(), skip_special_tokens=True)
        for i in rows
    ]


def _holds_stop(tokenizer, ids: list, stops: list) -> bool:
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return any(stop in text for stop in stops)


def cut_at_stop_strings(rollout, tokenizer, stops: list):
    """``rollout`` with each row that contains one of ``stops`` ended at the token completing the
    first of them: length, mask, log-probs (0 past the end) and finish reason ``"stop"``."""
    if not stops:
        return rollout
    lens = rollout.response_lens.clone()
    reasons = list(rollout.finish_reason)
    for i, n in enumerate(rollout.response_lens.tolist()):
        ids = rollout.response_ids[i, :n].tolist()
        if not _holds_stop(tokenizer, ids, stops):
            continue
        low, high = 1, n  # the shortest prefix that holds a stop string is in [low, high]
        while low < high:
            middle = (low + high) // 2
            if _holds_stop(tokenizer, ids[:middle], stops):
                high = middle
            else:
                low = middle + 1
        lens[i], reasons[i] = low, "stop"
    R = rollout.response_ids.shape[1]
    mask = torch.arange(R, device=lens.device) < lens[:, None].to(rollout.response_mask.device)  # (B, R)
    return dataclasses.replace(
        rollout,
        response_mask=mask,
        response_lens=lens,
        logprobs=rollout.logprobs * mask,
        response_ids=rollout.response_ids.masked_fill(~mask, _pad(rollout)),
        finish_reason=reasons,
        versions=None if rollout.versions is None else rollout.versions * mask,
    )


def gather_rows(picks: list):
    """One rollout of the rows ``picks`` names, ``[(rollout, row), ...]``, in that order, right-padded
    to the widest of their rollouts."""
    from ...rollout import Rollout

    R = max(rollout.response_ids.shape[1] for rollout, _ in picks)

    def widen(x, row, fill):  # (R_i,) -> (R,)
        return torch.cat([x[row], x.new_full((R - x.shape[1],), fill)])

    pad = _pad(picks[0][0])
    return Rollout(
        [rollout.prompt_ids[row] for rollout, row in picks],
        torch.stack([widen(ro.response_ids, row, pad) for ro, row in picks]),
        torch.stack([widen(ro.response_mask, row, False) for ro, row in picks]),
        torch.stack([ro.response_lens[row] for ro, row in picks]),
        torch.stack([widen(ro.logprobs, row, 0.0) for ro, row in picks]),
        [ro.finish_reason[row] for ro, row in picks],
    )


def _pad(rollout) -> int:
    """The pad id the sampler filled ended rows with (read from a padded entry, else 0)."""
    padded = ~rollout.response_mask
    return int(rollout.response_ids[padded][0]) if padded.any() else 0


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025): 0 up to ``max_new_tokens - buffer``
    tokens, then falling linearly to ``-penalty`` at ``max_new_tokens``. ``(B,)`` fp32."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * over / buffer
