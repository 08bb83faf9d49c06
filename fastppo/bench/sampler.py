"""Bench cases for the rollout step: the sampler against ``generate()``, and the token draw alone.

``sampler``: rollout throughput against Hugging Face ``generate()``, on a random model (below) and
on a real pretrained one with a fixed and a long-tail workload (``sampler_real.py``; not at
``--quick`` sizes).

The model is built from a config with random weights (nothing is downloaded): on CUDA a bf16
model shaped like Qwen2.5-0.5B (24 layers, hidden 896, 151,936-token vocabulary); on CPU, and
for ``--quick``, a tiny fp32 Llama (2 layers, hidden 64, 1,000 tokens), where the numbers measure
per-step overhead more than model work. Every row gets a prompt of ``PROMPT`` tokens and samples ``NEW`` tokens
(no stop token), so all contenders do the same work.

Bytes, the fewest a rollout must move: each decode step reads every weight once and each row's
live KV cache, so ``NEW * weight_bytes + B * sum_s (PROMPT + s) * kv_bytes_per_token``. GB/s is
then the achieved decode bandwidth and "% copy" the share of the decode limit. The rate column is
generated tokens per second.

``sampling``: ``sample_tokens`` (one draw and log-prob per row from ``(B, V)`` logits) against the
naive way, an fp32 softmax, ``torch.multinomial`` and a log-softmax gather (what ``generate()``
does per step, plus the log-prob PPO needs). Bytes: the logits read once, ``B*V*e``, and the
token and log-prob written.
"""

import itertools

import torch

import fastppo

from .case import Case, Contender, compiled, random_tokens
from .logprobs import dtype_for
from .sampler_real import real_sampler_cases, rollout_bytes

FULL = dict(batches=(1, 16, 64, 256), prompt=128, new=128)
QUICK = dict(batches=(1, 4), prompt=16, new=16)
DRAW_ROWS, DRAW_VOCABS = (1, 64, 256), (32000, 151936)
QUICK_DRAW_ROWS, QUICK_DRAW_VOCABS = (64,), (1000,)


def tiny_model(device: torch.device, quick: bool):
    """A random model from a config: a tiny fp32 Llama on CPU or for ``--quick``, else Qwen2.5-0.5B's
    shape in bf16 (see the module's docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if quick or device.type != "cuda":
        config = LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            bos_token_id=None,
            eos_token_id=None,
        )
        return LlamaForCausalLM(config).to(device).eval()
    config = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    return Qwen2ForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def _hf_generate(model, prompt_ids, new: int, **options):
    ids = torch.tensor(prompt_ids, device=model.device)  # (B, PROMPT): equal lengths, no padding
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=True,
        top_k=0,
        eos_token_id=None,
        pad_token_id=0,
        **options,
    )


def sampler_cases(device: torch.device, quick: bool) -> list:
    sizes = QUICK if quick else FULL
    prompt, new = sizes["prompt"], sizes["new"]
    model = tiny_model(device, quick)
    cases = []
    for B in sizes["batches"]:

        def make(B=B):
            sampler = fastppo.Sampler(model, max_batch_size=B, max_seq_len=prompt + new)
            prompts = torch.randint(0, model.config.vocab_size, (B, prompt)).tolist()
            return {"model": model, "sampler": sampler, "prompts": prompts}

        contenders = [
            Contender(
                "fastppo",
                lambda x: (
                    x["sampler"]
                    .generate(x["prompts"], max_new_tokens=new, temperature=1.0, stop_token_ids=(), seed=0)
                    .response_ids
                ),
            ),
            Contender(
                "HF generate (dynamic cache)", lambda x: _hf_generate(x["model"], x["prompts"], new), baseline=True
            ),
            # Without generate()'s automatic torch.compile: compiling per batch size takes minutes.
            Contender(
                "HF generate (static cache, no compile)",
                lambda x: _hf_generate(
                    x["model"], x["prompts"], new, cache_implementation="static", disable_compile=True
                ),
            )
            if device.type == "cuda"
            else Contender("HF generate (static cache, no compile)", status="CUDA only"),
        ]
        cases.append(
            Case(
                "sampler",
                f"B={B} prompt={prompt} new={new}",
                make,
                contenders,
                bytes_fwd=rollout_bytes(model, [prompt] * B, [new] * B),
                items=B * new,
            )
        )
    return cases + real_sampler_cases(device, quick)


def naive_sample(logits, temperature: float = 1.0):
    """A draw with its log-prob the way a PyTorch loop writes it: fp32 copies and a multinomial."""
    z = logits.float() / temperature  # (B, V)
    tokens = torch.multinomial(torch.softmax(z, dim=-1), 1)  # (B, 1)
    return tokens.squeeze(1), torch.log_softmax(z, dim=-1).gather(1, tokens).squeeze(1)


def sampling_cases(device: torch.device, quick: bool) -> list:
    dtype = dtype_for(device)
    e = torch.finfo(dtype).bits // 8
    compiled_naive = compiled("torch.compile(naive)", lambda x: naive_sample(x["logits"]), device)
    cases = []
    shapes = (QUICK_DRAW_ROWS, QUICK_DRAW_VOCABS) if quick else (DRAW_ROWS, DRAW_VOCABS)
    for B, V in itertools.product(*shapes):

        def make(B=B, V=V):
            return {"logits": random_tokens(B, V, device=device, dtype=dtype)}

        contenders = [
            Contender("fastppo", lambda x: fastppo.sample_tokens(x["logits"], temperature=1.0, seed=7)),
            Contender("naive", lambda x: naive_sample(x["logits"]), baseline=True),
            compiled_naive,
        ]
        cases.append(Case("sampling", f"B={B} V={V}", make, contenders, bytes_fwd=B * V * e + 12 * B, items=B))
    return cases
