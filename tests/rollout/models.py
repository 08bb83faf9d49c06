"""The sampler's tests' models and references: tiny random models of every family, Hugging Face's
greedy decoding and a full forward's log-probs to compare the sampler with, and the prompts.

``FAMILIES`` holds the hand-written forwards' families, GPT-NeoX (its own modules over fastppo's
cache) and ``GENERIC``, a family whose attention is its own code (XGLM), which decodes on
the generic path. ``interface_model`` builds any other family transformers ships from its own
config class, at the same tiny size."""

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    XGLMConfig,
    XGLMForCausalLM,
)

import fastppo

V = 97
LLAMA_LIKE = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42]]  # ragged


FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_LIKE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_LIKE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA_LIKE, head_dim=8)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA_LIKE, sliding_window=6)),  # window < sequence
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(
            vocab_size=V,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            initializer_range=0.2,
            bos_token_id=V - 1,
            eos_token_id=V - 1,
        )
    ),
    "gpt_neox": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=128,
            initializer_range=0.2,
            bos_token_id=None,
            eos_token_id=None,
        )
    ),
    "xglm": lambda: XGLMForCausalLM(
        XGLMConfig(
            vocab_size=V,
            d_model=32,
            ffn_dim=64,
            num_layers=2,
            attention_heads=4,
            max_position_embeddings=128,
            init_std=0.02,
            scale_embedding=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
    ),
}
GENERIC = "xglm"


# Any decoder family at the same tiny size, from its own config class: the fields a family does not
# read are ignored; a window only where the family's config has one (else the config would carry a
# window its masks never apply).
INTERFACE_SIZE = dict(
    LLAMA_LIKE,
    head_dim=8,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
INTERFACE_EXTRA = {
    "gptj": dict(rotary_dim=4),
    "codegen": dict(rotary_dim=4),
    "deepseek_v2": dict(num_key_value_heads=4),  # MLA: every head its own keys
}


def interface_model(family, window=6, **extra):
    fields = {**INTERFACE_SIZE, **INTERFACE_EXTRA.get(family, {}), **extra}
    if hasattr(AutoConfig.for_model(family), "sliding_window"):
        fields.setdefault("sliding_window", window)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields)).eval()


def tiny(family):
    torch.manual_seed(0)
    return FAMILIES[family]().eval()


def hf_greedy(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def recomputed_logprobs(model, rollout, row, temperature):
    prompt, n = rollout.prompt_ids[row], int(rollout.response_lens[row])
    response = rollout.response_ids[row, :n]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response.tolist()])).logits[0, len(prompt) - 1 : len(prompt) - 1 + n]
    return fastppo.token_logprobs(logits, response, temperature=temperature)


# Ragged prompts (length 1 included) with ragged budgets, so rows end at different steps.
RAGGED_PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9, 10, 11], [42], [7, 7], [3, 1, 4, 1, 5], [60]]


BUDGETS = [9, 3, 12, 5, 2, 7]
