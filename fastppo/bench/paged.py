"""Bench cases for the rollout's KV cache: the paged cache (``fastppo/rollout/paged.py``) against the
static one, on SmolLM2-135M-Instruct (``smollm2.py``) and the long-tail chat workload.

The workload is RL's: ``PROMPTS`` chat prompts of about 250 tokens (a long system message and a
question), ``SAMPLES`` samples each (a GRPO group), row lengths drawn from the long-tail
distribution of ``sampler_real.py`` (median 24 tokens, a budget of 256), imposed per row with the
end-of-sequence token off, so every contender generates the same tokens.

Two cases:

- **equal rows**: both caches with a slot for every row and memory enough for all of them: the
  paged cache's cost (a gather of each row's blocks per layer and step on the SDPA path) shows as
  tokens per second against the static cache's view.
- **same memory**: a KV budget of ``BUDGET_ROWS`` rows at the cap. The static cache holds that many
  rows (a slot is a row at the cap); the paged cache takes every row it can in the same bytes,
  sharing each group's prompt blocks and admitting rows while the memory covers them. The note
  gives the rows in flight at most and the KV bytes held at the peak.

At ``--quick`` sizes a tiny random Llama stands in for the model (the suite's smoke test).
"""

import torch

import fastppo

from .case import Case, Contender, unavailable
from .sampler import tiny_model
from .sampler_real import BUDGET, QUESTIONS, kv_bytes_per_token, long_tail_lengths, rollout_bytes
from .smollm2 import Unavailable, load_smollm2

PROMPTS, SAMPLES = 6, 8
BUDGET_ROWS = 8  # the same-memory case's budget: this many rows at the cap
BLOCK = 16
SYSTEM = (
    "You are a careful assistant for a school. Answer the student's question in plain words. "
    "Think about what the student already knows, define any term you use, and give one short "
    "example. If the question has a number for an answer, show each step of the working on its "
    "own line and check the result at the end. If the question is about a text, a place or a "
    "person, say where the facts come from and what is still debated. Keep the tone warm and "
    "encouraging, never condescending. Do not invent facts: when you are not sure, say so and "
    "suggest how the student could find out. Use short paragraphs. Avoid lists unless the "
    "question asks for several items. Do not repeat the question. End with one sentence that "
    "invites a follow-up question about the same topic, phrased as a question the student might "
    "ask next. Remember that the student may be reading on a small screen, so prefer short words "
    "and short sentences, and never use tables or code blocks unless they are asked for."
)


def _prompts(tokenizer) -> list:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[i]}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        for i in range(PROMPTS)
    ]


def _kv_note(sampler) -> str:
    cache = sampler.kv_cache
    if cache.paged:
        held = cache.peak_blocks * cache.block_bytes
    else:
        held = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    return f"{sampler.peak_rows} rows in flight at most, KV {held / 2**20:.3g} MiB held at the peak"


def paged_cases(device: torch.device, quick: bool) -> list:
    """The equal-rows and same-memory cases; without the model, one case saying how to get it."""
    names = ["static cache", f"paged cache ({BLOCK}-position blocks)"]
    if quick:
        model, budget, samples = tiny_model(device, quick=True), 16, 2
        prompts = [[(7 * i + j) % 1000 for j in range(40)] for i in range(2)]
    else:
        try:
            model, tokenizer = load_smollm2(device)
        except Unavailable as why:
            return [unavailable("rollout", "SmolLM2-135M-Instruct", names, why)]
        prompts, budget, samples = _prompts(tokenizer), BUDGET, SAMPLES
    rows = len(prompts) * samples
    lengths = long_tail_lengths(rows, budget)
    longest = max(map(len, prompts)) + budget
    memory = BUDGET_ROWS * longest * kv_bytes_per_token(model)  # BUDGET_ROWS rows at the cap, static layout

    def sampler(slots, **kv):
        return fastppo.Sampler(model, max_batch_size=slots, max_seq_len=longest, **kv)

    layouts = {
        "equal rows": (sampler(rows, kv_cache="static"), sampler(rows, kv_block_size=BLOCK)),
        f"same memory, {memory / 2**20:.0f} MiB of KV": (
            sampler(BUDGET_ROWS, kv_cache="static"),
            sampler(rows, kv_block_size=BLOCK, kv_memory=memory),
        ),
    }
    cases = []
    for name, samplers in layouts.items():

        def contender(i, samplers=samplers):
            return Contender(
                names[i],
                lambda x: (
                    samplers[i]
                    .generate(
                        prompts,
                        max_new_tokens=lengths,
                        temperature=1.0,
                        stop_token_ids=(),
                        seed=0,
                        num_samples_per_prompt=samples,
                    )
                    .response_ids
                ),
                baseline=i == 0,
                note=lambda x: _kv_note(samplers[i]),
            )

        label = (
            f"{'tiny Llama' if quick else 'SmolLM2-135M'} {name}: {len(prompts)} prompts of "
            f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens x {samples} samples, new tokens mean "
            f"{sum(lengths) / rows:.0f} max {max(lengths)}"
        )
        cases.append(
            Case(
                "rollout",
                label,
                dict,
                [contender(0), contender(1)],
                items=sum(lengths),
                bytes_fwd=rollout_bytes(model, [len(p) for p in prompts for _ in range(samples)], lengths),
            )
        )
    return cases
