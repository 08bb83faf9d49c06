"""Bench cases for the rollout step on a real pretrained model: SmolLM2-135M-Instruct (``smollm2.py``).

The prompts are chat questions rendered with the model's own template (ragged, 30-45 tokens).
Two workloads, each sampled at temperature 1 with the end-of-sequence token disabled, every row
stopping at a length fixed in advance, so that every contender generates exactly the same
number of tokens per row:

- ``fixed``: every row samples ``FIXED_NEW`` tokens (today's bench case, on a real model);
- ``long tail``: a budget of ``BUDGET`` tokens, row lengths drawn from a log-normal (median
  ``MEDIAN``, sigma ``SIGMA``) and clipped to the budget: most responses stop early and a few run
  long, as RL responses do.

The lengths are imposed the way each contender can: fastppo per-row ``max_new_tokens``;
``generate()`` runs every row to the longest, which is what it does when rows end at an EOS (the
ended row is padded and decoded on); transformers' continuous batching a per-request
``max_new_tokens``. Contenders: fastppo's ``Sampler`` with a slot per row (finished rows leave the
batch) and with a third as many (rows wait for free slots: continuous batching), ``generate()``
with its dynamic cache over all rows at once, and transformers' continuous batching
(``continuous_batching_context_manager``) where it runs.

The rate column is useful tokens per second (every token generated counts: none is masked).
The note gives the wasted-row share: of the rows run by the decode steps, those whose token is
thrown away (a row that has ended, a free slot). Bytes, the fewest a rollout must move: all rows
in one batch, each step reading the weights once and each row its live KV cache.
"""

import math

import torch

import fastppo

from .case import Case, Contender, unavailable
from .smollm2 import Unavailable, load_smollm2

QUESTIONS = (
    "What is 17 times 23?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain why the sky is blue.",
    "What is the capital of Australia?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Summarise the plot of Romeo and Juliet.",
    "What is photosynthesis?",
    "Translate 'good morning' into French.",
    "List four planets of the solar system.",
    "What does a thermometer measure?",
    "Solve for x: 3x + 5 = 20.",
    "Why do leaves change color in autumn?",
    "Write one sentence about a cat.",
    "What is the boiling point of water in Fahrenheit?",
)
ROWS = 48
SLOTS = (48, 16)
FIXED_NEW = 64
BUDGET, MEDIAN, SIGMA = 256, 24, 1.0


def _prompts(tokenizer, rows: int) -> list:
    prompts = []
    for i in range(rows):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        prompts.append(
            list(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
                    "input_ids"
                ]
            )
        )
    return prompts


def long_tail_lengths(rows: int, budget: int, seed: int = 0) -> list:
    """Row lengths from a log-normal (median ``MEDIAN``, sigma ``SIGMA``), in ``[1, budget]``."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randn(rows, generator=generator, dtype=torch.float64) * SIGMA + math.log(MEDIAN)
    return draws.exp().round().clamp(1, budget).long().tolist()


def _hf_generate(model, prompts: list, lengths: list):
    """Every row to the longest length: what ``generate()`` does when rows end at an EOS (it pads
    them and goes on decoding them), so row i's response is its first ``lengths[i]`` tokens."""
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=model.device)  # left-padded
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    return model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max(lengths),
        min_new_tokens=max(lengths),
        do_sample=True,
        top_k=0,
        eos_token_id=None,
        pad_token_id=0,
    )


def _hf_continuous(model, prompts: list, lengths: list):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=max(lengths), eos_token_id=None, pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=60) as manager:
        ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("continuous batching returned no result within 60 s")
            results[result.request_id] = result.generated_tokens
    return [results[i] for i in ids]


def _waste(decoded: int, lengths: list) -> str:
    useful = sum(n - 1 for n in lengths)  # each row's first token comes from its prefill
    return f"{100 * (1 - useful / decoded):.0f}% of decoded rows wasted" if decoded else ""


def rollout_bytes(model, prompt_lens: list, lengths: list) -> int:
    """The fewest bytes a rollout of rows with these prompt and response lengths moves: all in one
    batch, each decode step reads every weight once and each row's live KV cache."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    return max(lengths) * weights + sum(
        sum(p + s for s in range(n)) for p, n in zip(prompt_lens, lengths)
    ) * kv_bytes_per_token(model)


def kv_bytes_per_token(model) -> int:
    """Bytes of one position's keys and values over all of ``model``'s layers, in its dtype."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * model.dtype.itemsize


def real_sampler_cases(device: torch.device, quick: bool) -> list:
    """The two workloads; without the model, one case whose rows say how to get it; none at
    ``--quick`` sizes (a smoke test of the suite loads no real model)."""
    if quick:
        return []
    contender_names = [f"fastppo, {n} slots" for n in SLOTS] + [
        "HF generate (dynamic cache)",
        "transformers continuous batching",
    ]
    try:
        model, tokenizer = load_smollm2(device)
    except Unavailable as why:
        return [unavailable("sampler", "SmolLM2-135M-Instruct", contender_names, why)]
    rows = ROWS
    prompts = _prompts(tokenizer, rows)
    workloads = {"fixed": [FIXED_NEW] * rows, "long tail": long_tail_lengths(rows, BUDGET)}
    cases = []
    for name, lengths in workloads.items():

        def make(lengths=lengths):
            longest = max(map(len, prompts)) + max(lengths)
            samplers = [fastppo.Sampler(model, max_batch_size=n, max_seq_len=longest) for n in SLOTS]
            return {"model": model, "samplers": samplers, "prompts": prompts, "lengths": lengths}

        def fastppo_contender(i):
            return Contender(
                contender_names[i],
                lambda x: (
                    x["samplers"][i]
                    .generate(x["prompts"], max_new_tokens=x["lengths"], temperature=1.0, stop_token_ids=(), seed=0)
                    .response_ids
                ),
                note=lambda x: _waste(x["samplers"][i].rows_decoded, x["lengths"]),
            )

        def hf_waste(x):
            return _waste(len(x["lengths"]) * (max(x["lengths"]) - 1), x["lengths"])

        contenders = [fastppo_contender(i) for i in range(len(SLOTS))] + [
            Contender(
                contender_names[-2],
                lambda x: _hf_generate(x["model"], x["prompts"], x["lengths"]),
                baseline=True,
                note=hf_waste,
            ),
            Contender(contender_names[-1], lambda x: _hf_continuous(x["model"], x["prompts"], x["lengths"]))
            if hasattr(model, "continuous_batching_context_manager")
            else Contender(contender_names[-1], status="not in this transformers"),
        ]
        label = f"SmolLM2-135M {name}: {rows} rows, new tokens mean {sum(lengths) / rows:.0f} max {max(lengths)}"
        cases.append(
            Case(
                "sampler",
                label,
                make,
                contenders,
                items=sum(lengths),
                bytes_fwd=rollout_bytes(model, [len(p) for p in prompts], lengths),
            )
        )
    return cases
