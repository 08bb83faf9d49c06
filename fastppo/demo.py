"""``fastppo demo``: the log-prob ops on a real Hugging Face causal LM, end to end, on any machine.

It builds a small Llama from a config (random weights, no download), runs one batch through it,
and computes every token's log-prob and entropy three ways: from the full logits with
``token_logprobs``, from the last hidden states with ``token_logprobs_from_hidden`` (no logits at
all), and with plain float64 PyTorch as the reference. It prints how far each is from the
reference, for the values and for the LM head's gradient, and how much memory the logits would
have taken.
"""

import argparse
import math
import time

import torch

from .ops import token_logprobs, token_logprobs_from_hidden


def build_tiny_llama(vocab_size: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def _reference(hidden, weight, labels, temperature):
    """float64 log-probs and entropy of ``labels``: plain log_softmax + gather."""
    log_p = torch.log_softmax(hidden.double() @ weight.double().T / temperature, dim=-1)
    logp = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return logp, -(log_p.exp() * log_p).sum(-1)


def run_demo(
    *,
    device: str = "cpu",
    backend: str = "auto",
    batch: int = 4,
    seq_len: int = 128,
    vocab_size: int = 32000,
    temperature: float = 0.9,
    seed: int = 0,
) -> dict:
    """Run the comparison and return its numbers (also printed by :func:`main`)."""
    model = build_tiny_llama(vocab_size, seed).to(device)
    ids = torch.randint(0, vocab_size, (batch, seq_len), device=device)
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids).last_hidden_state[:, :-1]  # (B, T-1, H)
    labels = ids[:, 1:]  # (B, T-1): each position predicts the next token
    weight = model.get_output_embeddings().weight.detach()  # (V, H)
    ref_logp, ref_entropy = _reference(hidden, weight, labels, temperature)

    results = {}
    for name in ("token_logprobs", "token_logprobs_from_hidden"):
        w = weight.clone().requires_grad_()
        start = time.perf_counter()
        if name == "token_logprobs":
            logits = hidden @ w.T  # (B, T-1, V): the tensor the fused path never builds
            logp, entropy = token_logprobs(
                logits, labels, temperature=temperature, return_entropy=True, backend=backend
            )
        else:
            logp, entropy = token_logprobs_from_hidden(
                hidden, w, labels, temperature=temperature, return_entropy=True, backend=backend
            )
        (logp.sum() + 0.1 * entropy.sum()).backward()
        seconds = time.perf_counter() - start
        results[name] = dict(
            logp_err=(logp.double() - ref_logp).abs().max().item(),
            entropy_err=(entropy.double() - ref_entropy).abs().max().item(),
            grad=w.grad,
            seconds=seconds,
        )

    ref_w = weight.double().requires_grad_()
    ref_logp, ref_entropy = _reference(hidden, ref_w, labels, temperature)
    (ref_logp.sum() + 0.1 * ref_entropy.sum()).backward()
    for r in results.values():
        r["grad_rel_err"] = ((r.pop("grad").double() - ref_w.grad).norm() / ref_w.grad.norm()).item()
    results["tokens"] = labels.numel()
    results["full_logits_mib"] = labels.numel() * vocab_size * 4 / 2**20
    results["mean_logp"] = ref_logp.mean().item()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastppo demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    r = run_demo(
        device=args.device,
        backend=args.backend,
        batch=args.batch,
        seq_len=args.seq_len,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    print(f"tiny Llama, {r['tokens']} tokens, V={args.vocab_size}, device={args.device}, backend={args.backend}")
    uniform = -math.log(args.vocab_size)
    print(f"mean log-prob of the next token: {r['mean_logp']:.4f}  (uniform would be {uniform:.4f})")
    print(f"{'op':<24}{'max |logp err|':>16}{'max |H err|':>14}{'LM-head grad rel err':>22}{'seconds':>10}")
    for name in ("token_logprobs", "token_logprobs_from_hidden"):
        x = r[name]
        print(
            f"{name:<24}{x['logp_err']:>16.2e}{x['entropy_err']:>14.2e}{x['grad_rel_err']:>22.2e}{x['seconds']:>10.3f}"
        )
    print(
        f"errors are against float64 PyTorch; token_logprobs_from_hidden never built the "
        f"{r['full_logits_mib']:.0f} MiB of fp32 logits"
    )
    return 0
