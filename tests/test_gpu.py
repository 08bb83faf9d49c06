"""Checks that need a real GPU: int64 offsets past 2**31 elements, CUDA-graph capture, and the
memory bound of the ops from hidden states under the CUDA allocator. Skipped without CUDA."""

import pytest
import torch

import fastppo
from tests.oracles import assert_values_close, logprobs_oracle

pytestmark = pytest.mark.gpu


def test_logits_past_two_to_the_31_elements():
    N, V = 16_385, 131_072  # N * V = 2**31 + V elements of bf16: 4.3 GB
    logits = torch.empty(N, V, dtype=torch.bfloat16, device="cuda").normal_()
    labels = torch.randint(0, V, (N,), device="cuda")
    logits.requires_grad_()
    logp, entropy = fastppo.token_logprobs(logits, labels, return_entropy=True)
    tail = slice(N - 3, N)  # rows whose offsets only int64 can address
    ref_logp, ref_entropy = logprobs_oracle(logits.detach()[tail], labels[tail])
    assert_values_close(logp[tail], ref_logp, torch.bfloat16, logit_scale=6.0)
    assert_values_close(entropy[tail], ref_entropy, torch.bfloat16, logit_scale=6.0)
    logp[tail].sum().backward()
    grad = logits.grad
    assert torch.isfinite(grad[tail].float()).all() and (grad[tail].float().abs().sum(1) > 0).all()
    assert (grad[: N - 3] == 0).all()


def test_cuda_graph_capture():
    # No op synchronises with the host, so a whole loss can be captured and replayed.
    B, T, V = 4, 64, 1000
    logits = torch.randn(B, T, V, device="cuda")
    labels = torch.randint(0, V, (B, T), device="cuda")
    old = torch.randn(B, T, device="cuda") - 5
    adv = torch.randn(B, T, device="cuda")
    mask = torch.rand(B, T, device="cuda") > 0.2

    def step():
        loss, stats = fastppo.ppo_loss_from_logits(logits, labels, old, adv, mask, entropy_coef=0.01)
        advantages, _ = fastppo.gae(adv, old, mask)
        return loss, stats["clipfrac"], advantages

    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a, b)


def test_from_hidden_memory_bound_on_the_allocator():
    N, H, V, chunk = 4096, 64, 32_000, 128
    hidden = torch.randn(N, H, device="cuda", requires_grad=True)
    weight = torch.randn(V, H, device="cuda", requires_grad=True)
    labels = torch.randint(0, V, (N,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, entropy = fastppo.token_logprobs_from_hidden(hidden, weight, labels, return_entropy=True, chunk_size=chunk)
    (logp.sum() + entropy.sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    chunk_bytes, full_bytes = chunk * V * 4, N * V * 4
    # chunk buffer + fp32 weight-gradient accumulator + the gradients themselves, nothing N x V
    assert extra < 2 * chunk_bytes + 3 * V * H * 4 + 4 * N * H * 4 + (1 << 20)
    assert extra * 10 < full_bytes


def test_sampler_cuda_graphs_match_eager_decoding():
    from tests.rollout.models import PROMPTS, tiny

    model = tiny("qwen3").cuda()
    runs = {}
    for graphs in (True, False):
        sampler = fastppo.Sampler(model, max_batch_size=16, max_seq_len=128, cuda_graphs=graphs)
        assert (sampler.graphs is not None) == graphs
        runs[graphs] = [
            sampler.generate(
                PROMPTS, max_new_tokens=40, temperature=t, stop_token_ids=(), seed=5, num_samples_per_prompt=2
            )
            for t in (0.0, 0.9)
        ]
    for with_graphs, eager in zip(runs[True], runs[False]):
        assert torch.equal(with_graphs.response_ids, eager.response_ids)
        torch.testing.assert_close(with_graphs.logprobs, eager.logprobs, rtol=0, atol=1e-5)


def test_a_stream_on_cuda_graphs_matches_eager_decoding():
    """Batches entering a stream one ahead (one of them a row per prompt), the weights changed
    between takes, replayed through the CUDA graphs: the tokens and log-probs of eager decoding."""
    from tests.rollout.models import RAGGED_PROMPTS, tiny

    added = [(RAGGED_PROMPTS[0:2], False), (RAGGED_PROMPTS[2:6], True), (RAGGED_PROMPTS[4:6], False)]
    runs = {}
    for graphs in (True, False):
        model = tiny("qwen3").cuda()
        sampler = fastppo.Sampler(model, max_batch_size=3, max_seq_len=64, cuda_graphs=graphs)
        assert (sampler.graphs is not None) == graphs
        stream = sampler.stream(
            prompts_per_batch=2, ahead=1, max_new_tokens=20, temperature=0.9, num_samples_per_prompt=2, seed=3
        )
        runs[graphs] = []
        for k in range(3):
            while stream.loop.added < min(k + 2, 3):
                prompts, per_row = added[stream.loop.added]
                stream.add(prompts, per_row=per_row)
            if k:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.01)
            runs[graphs].append(stream.next(version=k))
    for with_graphs, eager in zip(runs[True], runs[False]):
        assert torch.equal(with_graphs.response_ids, eager.response_ids)
        assert torch.equal(with_graphs.versions, eager.versions)
        torch.testing.assert_close(with_graphs.logprobs, eager.logprobs, rtol=0, atol=1e-5)
