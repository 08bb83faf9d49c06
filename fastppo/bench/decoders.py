"""Bench cases for the sampler's three decoders (``rollout/decoders.py``) on the chat workload.

A rollout of 2 chat prompts (``chat_workload.py``, about 280 tokens each with SmolLM2's template) x 8
samples x 96 new tokens, sampled at temperature 1 with stop tokens off, so every contender generates
exactly the same number of tokens. Contenders, each a ``Sampler`` of 16 slots named by ``decoder=``:
``lean`` (a hand-written forward on packed weights), ``modules`` (the model's own modules, attending
over fastppo's KV cache) and ``generic`` (its own forward and cache: waves, each sample's prompt
prefilled again), the baseline. Models: SmolLM2-135M-Instruct, a family with a hand-written forward
(all three decoders; on a CPU in fp32 and in bf16), and two families without one, built at
SmolLM2's size from their configs with random weights (a decode step costs the same whatever the
weights): Qwen3-MoE (8 experts, 2 a token) and Gemma 3 (local and global layers). The rate is
generated tokens per second. At ``--quick`` sizes (the suite's smoke test) the three families are
random and tiny, the prompts random tokens."""

import copy

import torch

import fastppo

from .case import Case, Contender, unavailable
from .smollm2 import Unavailable, load_smollm2

PROMPTS, SAMPLES, NEW_TOKENS = 2, 8, 96
# SmolLM2-135M's shape, for the families built at its size
SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64
)
TINY = dict(
    vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
)
RANDOM_FAMILIES = {
    "Llama": ("llama", dict(intermediate_size=1536)),
    "Qwen3-MoE": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192)),
    "Gemma 3": ("gemma3_text", dict(intermediate_size=1536, sliding_window=512, query_pre_attn_scalar=64)),
}


def chat_prompts(tokenizer) -> list:
    from .chat_workload import rows

    return [
        list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ])
        for row in rows(PROMPTS)
    ]  # fmt: skip


def random_model(family: str, device: torch.device, size: dict = SMOLLM2):
    """A model of ``family`` (a key of ``RANDOM_FAMILIES``) of ``size``, random weights in the dtype
    SmolLM2 loads in on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = RANDOM_FAMILIES[family]
    config = AutoConfig.for_model(model_type, **size, **fields, tie_word_embeddings=True)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def _case(label: str, model, prompts: list, decoders: tuple, new_tokens: int = NEW_TOKENS) -> Case:
    longest = max(map(len, prompts)) + new_tokens

    def make():
        samplers = {
            d: fastppo.Sampler(model, max_batch_size=PROMPTS * SAMPLES, max_seq_len=longest, decoder=d)
            for d in decoders
        }
        return {"samplers": samplers}

    def contender(decoder):
        def run(x):
            return (
                x["samplers"][decoder]
                .generate(
                    prompts,
                    max_new_tokens=new_tokens,
                    temperature=1.0,
                    stop_token_ids=(),
                    num_samples_per_prompt=SAMPLES,
                    seed=0,
                )
                .response_ids
            )

        return Contender(decoder, run, baseline=decoder == "generic")

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return Case(
        "decoders",
        f"{label}: {PROMPTS} chat prompts ({', '.join(str(len(p)) for p in prompts)} tokens) x {SAMPLES} samples "
        f"x {new_tokens} new tokens",
        make,
        [contender(d) for d in decoders],
        items=PROMPTS * SAMPLES * new_tokens,
        bytes_fwd=new_tokens * params,  # the weights read once a step: the least a rollout moves
    )


def _random_prompts(vocab: int, lengths: tuple) -> list:
    return [torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def decoder_cases(device: torch.device, quick: bool) -> list:
    """SmolLM2-135M through each decoder, and the random families through theirs (on random prompts of
    the chat prompts' lengths where SmolLM2's tokenizer is missing); at ``--quick`` sizes tiny random
    models (a smoke test of the suite builds no 135M model)."""
    if quick:
        prompts = _random_prompts(TINY["vocab_size"], (12, 9))
        return [
            _case(f"{family}, tiny", random_model(family, device, TINY), prompts, decoders, new_tokens=8)
            for family, decoders in (("Llama", ("lean", "modules", "generic")), ("Qwen3-MoE", ("modules", "generic")))
        ]
    try:
        model, tokenizer = load_smollm2(device)
    except Unavailable as why:
        cases = [unavailable("decoders", "SmolLM2-135M-Instruct", ["lean", "modules", "generic"], why)]
        prompts = _random_prompts(SMOLLM2["vocab_size"], (280, 282))
    else:
        prompts = chat_prompts(tokenizer)
        cases = [_case("SmolLM2-135M", model, prompts, ("lean", "modules", "generic"))]
        if device.type == "cpu":  # and in bf16, the rollout dtype of a CPU with bf16 units (packed for them)
            half = copy.deepcopy(model).to(torch.bfloat16)
            cases.append(_case("SmolLM2-135M in bf16", half, prompts, ("lean", "modules", "generic")))
    for family in ("Qwen3-MoE", "Gemma 3"):
        cases.append(
            _case(f"{family}, random, SmolLM2's size", random_model(family, device), prompts, ("modules", "generic"))
        )
    return cases
