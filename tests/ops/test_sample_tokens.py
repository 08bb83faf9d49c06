"""sample_tokens: the kernel draws exactly argmax(z + Gumbel(Philox uniforms)) of a float64 oracle,
both backends follow softmax(logits / T), greedy ties and adversarial rows are exact, bad input is
named."""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import fastppo
from fastppo.kernels import sample_tokens as sampling_kernels
from fastppo.kernels.sample_tokens import sample_forward
from tests.oracles import chi2_critical, philox_uniform4


def gumbel_oracle(logits, temperature, seed):
    """float64 ``(tokens, logprobs, gap)``: the kernel's draw from its own uniforms, and the
    distance between the best and second-best noisy scores (draws closer than fp32 can tell apart
    are not compared)."""
    B, V = logits.shape
    z = logits.double().cpu() / temperature  # (B, V)
    per_row = -(-V // 4)  # column c of row r: output c % 4 of counter r * ceil(V / 4) + c // 4
    u = philox_uniform4(seed, np.arange(B * per_row, dtype=np.int64)).reshape(B, per_row * 4)[:, :V]
    u = torch.from_numpy(np.maximum(u, np.float32(2.0**-32))).double()
    score = z - torch.log(-torch.log(u))
    tokens = score.argmax(dim=1)
    logprobs = torch.log_softmax(z, dim=1).gather(1, tokens[:, None]).squeeze(1)
    if V == 1:
        return tokens, logprobs, torch.full((B,), math.inf)
    top2 = score.topk(2, dim=1).values
    return tokens, logprobs, top2[:, 0] - top2[:, 1]


def run_kernel(logits, temperature, seed, block_v=None, splits=None):
    B = logits.shape[0]
    tokens = torch.empty(B, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    sample_forward(
        logits, 1.0 if greedy else 1.0 / temperature, greedy, seed, tokens, logprobs, block_v=block_v, splits=splits
    )
    return tokens.cpu(), logprobs.cpu()


@pytest.mark.parametrize(
    "B,V,block_v,splits",
    [
        (7, 300, 64, None),
        (5, 1000, None, None),
        (3, 1, None, None),
        (64, 37, 16, None),
        (7, 300, 16, 4),
        (5, 1000, 32, 8),
    ],
)
@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7])
def test_kernel_draw_is_the_oracle_draw(device, B, V, block_v, splits, seed):
    logits = torch.randn(B, V, device=device) * 3
    tokens, logprobs = run_kernel(logits, 0.7, seed, block_v, splits)
    ref_tokens, ref_logprobs, gap = gumbel_oracle(logits, 0.7, seed)
    clear = gap > 1e-4
    assert clear.sum() >= B - 1  # a near-tie is rare: the comparison below must cover nearly all rows
    assert torch.equal(tokens[clear], ref_tokens[clear])
    torch.testing.assert_close(logprobs.double()[clear], ref_logprobs[clear], rtol=0, atol=2e-5)


def test_kernel_draw_does_not_depend_on_the_tiling(device):
    logits = torch.randn(9, 203, device=device)
    draws = [
        run_kernel(logits, 1.0, 42, block_v, splits)
        for block_v, splits in ((4, None), (16, None), (64, None), (256, None), (16, 2), (4, 8), (32, 4))
    ]
    for tokens, logprobs in draws[1:]:
        assert torch.equal(tokens, draws[0][0])
        torch.testing.assert_close(logprobs, draws[0][1], rtol=0, atol=1e-6)


def test_kernel_draw_in_bf16_and_from_a_strided_view(device):
    hidden = torch.randn(4, 6, 301, device=device).to(torch.bfloat16)  # (B, T, V)
    last = hidden[:, -1]  # (B, V), row stride T * V
    tokens, logprobs = run_kernel(last, 1.3, 99, block_v=128)
    ref_tokens, ref_logprobs, gap = gumbel_oracle(last, 1.3, 99)
    clear = gap > 1e-4
    assert torch.equal(tokens[clear], ref_tokens[clear])
    torch.testing.assert_close(logprobs.double()[clear], ref_logprobs[clear], rtol=0, atol=1e-4)


@pytest.mark.parametrize("width", [1000, 1004, 1001])  # rows read in units of 8, 4 and 1 for V = 1000
def test_kernel_draw_from_rows_padded_apart_is_the_oracle_draw(device, width):
    logits = (torch.randn(6, width, device=device) * 3)[:, :1000]
    for splits in (None, 2):
        tokens, logprobs = run_kernel(logits, 0.9, 7, block_v=256, splits=splits)
        ref_tokens, ref_logprobs, gap = gumbel_oracle(logits, 0.9, 7)
        clear = gap > 1e-4
        assert clear.sum() >= 5 and torch.equal(tokens[clear], ref_tokens[clear])
        torch.testing.assert_close(logprobs.double()[clear], ref_logprobs[clear], rtol=0, atol=2e-5)


def test_draws_follow_softmax_over_temperature(backend, device):
    draws, temperature = 4096, 0.8
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0, float("-inf"), 1.5], device=device)
    tokens, logprobs = fastppo.sample_tokens(row.expand(draws, -1), temperature=temperature, seed=3, backend=backend)
    probs = torch.softmax(row.double().cpu() / temperature, 0)
    counts = torch.bincount(tokens.cpu(), minlength=row.numel()).double()
    assert counts[6] == 0  # a -inf logit is never drawn
    seen = probs > 0
    chi2 = ((counts[seen] - draws * probs[seen]) ** 2 / (draws * probs[seen])).sum().item()
    assert chi2 < chi2_critical(int(seen.sum()) - 1), chi2
    torch.testing.assert_close(logprobs.double().cpu(), probs.log()[tokens.cpu()], rtol=0, atol=2e-5)


def test_greedy_takes_the_first_of_tied_maxima_across_blocks(backend, device):
    V = 5000  # more than one block of the kernel's widest (4096)
    logits = torch.zeros(4, V, device=device)
    logits[0, [17, 4500]] = 5.0  # a tie across blocks: the lower index wins
    logits[1, [4500, 17, 4501]] = 5.0
    logits[2, :] = float("-inf")
    logits[2, V - 1] = -3.0  # only the last column is finite
    logits[3, :] = float("-inf")
    logits[3, 0] = 7.0  # only the first
    tokens, logprobs = fastppo.sample_tokens(logits, temperature=0, backend=backend)
    assert tokens.tolist() == [17, 17, V - 1, 0]
    expected = torch.log_softmax(logits.double(), 1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_vocabulary_keeps_greedy_ties_and_lone_columns(device, splits):
    V = 300
    logits = torch.zeros(4, V, device=device)
    logits[0, [17, 250]] = 5.0  # a tie across splits: the lower column wins
    logits[1, [250, 17, 251]] = 5.0
    logits[2, :] = float("-inf")
    logits[2, V - 1] = -3.0  # only the last column is finite (the last split)
    logits[3, :] = float("-inf")  # nothing finite: column 0, log-prob NaN
    tokens, logprobs = run_kernel(logits, 0, 0, block_v=16, splits=splits)
    assert tokens.tolist() == [17, 17, V - 1, 0]
    expected = torch.log_softmax(logits[:3].double().cpu(), 1).gather(1, tokens[:3, None]).squeeze(1)
    torch.testing.assert_close(logprobs[:3].double(), expected, rtol=0, atol=2e-5)
    assert logprobs[3].isnan()


def test_peaked_rows_and_lone_finite_columns_are_drawn(backend, device):
    V = 130
    logits = torch.randn(3, V, device=device)
    logits[0, 77] += 50.0  # peaked: the draw is the peak, its log-prob <= 0 and near 0
    logits[1, 1:] = float("-inf")  # only column 0 can be drawn
    logits[2, :-1] = float("-inf")  # only column V - 1
    tokens, logprobs = fastppo.sample_tokens(logits, temperature=1.7, seed=5, backend=backend)
    assert tokens.tolist() == [77, 0, V - 1]
    assert (logprobs <= 0).all() and logprobs.abs().max() < 1e-6


def test_vocabulary_of_one(backend, device):
    tokens, logprobs = fastppo.sample_tokens(torch.randn(5, 1, device=device), temperature=0.5, backend=backend)
    assert tokens.tolist() == [0] * 5 and logprobs.abs().max() == 0


@pytest.mark.slow  # 70,000 rows through the Triton interpreter: about 20 s on 2 cores
def test_more_rows_than_the_grid_limit(device):
    logits = torch.full((65_537 + 100, 3), float("-inf"), device=device)
    logits[:, 1] = 0.0
    logits[-1] = torch.tensor([0.0, float("-inf"), float("-inf")])
    tokens, logprobs = fastppo.sample_tokens(logits, seed=1, backend="triton")
    assert (tokens[:-1] == 1).all() and tokens[-1] == 0 and (logprobs == 0).all()


def test_seed_reproduces_and_distinct_seeds_differ(backend, device):
    logits = torch.zeros(64, 50, device=device)
    first, _ = fastppo.sample_tokens(logits, seed=11, backend=backend)
    again, _ = fastppo.sample_tokens(logits, seed=11, backend=backend)
    other, _ = fastppo.sample_tokens(logits, seed=12, backend=backend)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_auto_backend_runs_top_k_and_top_p_on_the_twin(device):
    logits = torch.randn(256, 40, device=device)
    tokens, _ = fastppo.sample_tokens(logits, top_k=2, seed=0)
    allowed = logits.topk(2, dim=1).indices
    assert (allowed == tokens[:, None]).any(dim=1).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logits=torch.zeros(4)), "at least 2 dimension"),
        (dict(logits=torch.zeros(2, 3, 4)), r"shape \(B, V\)"),
        (dict(logits=torch.zeros(2, 0)), r"shape \(B, V\)"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=1.0), "seed"),
        (dict(backend="cuda"), "backend"),
        (dict(backend="triton", top_p=0.9), "top-k or top-p"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    arguments = {"logits": torch.zeros(2, 3), **kwargs}
    logits = arguments.pop("logits")
    with pytest.raises(ValueError, match=match):
        fastppo.sample_tokens(logits, **arguments)


def test_integer_logits_are_refused():
    with pytest.raises(TypeError, match="logits"):
        fastppo.sample_tokens(torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("top_p,nucleus", [(0.35, [0]), (0.65, [0, 1]), (0.75, [0, 1, 2]), (1.0, [0, 1, 2, 3, 4])])
def test_top_p_samples_exactly_the_nucleus(top_p, nucleus):
    """Probabilities 0.4, 0.3, 0.2, 0.06, 0.04: the nucleus is the shortest prefix whose mass reaches p,
    every token of it is drawn, none outside it, each as often as its renormalised probability."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    draws = 4000
    logits = probs.log()[torch.randperm(5)].repeat(draws, 1)  # a shuffled vocabulary: order is by probability
    order = torch.argsort(logits[0], descending=True)
    tokens, logprobs = fastppo.sample_tokens(logits, top_p=top_p, seed=5)
    expected = set(order[nucleus].tolist())
    assert set(tokens.tolist()) == expected
    kept = probs[nucleus] / probs[nucleus].sum()
    counts = torch.stack([(tokens == token).sum() for token in order[nucleus]]).double()
    torch.testing.assert_close(counts / draws, kept.double(), atol=0.03, rtol=0)
    torch.testing.assert_close(logprobs, logits[0, tokens].float() - torch.logsumexp(logits[0], 0))  # full-vocabulary


@triton.jit
def _approximate_log2(x):  # lg2.approx's worst case near 1: an absolute error up to 2**-22
    return tl.floor(tl.log2(x) * 4194304.0 + 0.5) / 4194304.0


@triton.jit
def _noise_kernel(u_ptr, out_ptr, N: tl.constexpr, NAIVE: tl.constexpr):
    u = tl.load(u_ptr + tl.arange(0, N))  # (N,)
    if NAIVE:
        noise = -sampling_kernels.log2(-sampling_kernels.log2(u))
    else:
        noise = sampling_kernels._gumbel2(u)
    tl.store(out_ptr + tl.arange(0, N), noise)


def test_gumbel_noise_is_finite_and_exact_near_u_1_under_the_gpus_approximate_log(monkeypatch):
    """The kernel's own noise arithmetic at u = 1 - k 2**-24, with its log2 replaced by one that
    errs as lg2.approx may (rounded to 2**-22, its documented absolute error near 1): the naive
    -log2(-log2(u)) then gives +inf noise at k = 1, a column that wins whatever its logit; the
    kernel's stays within 1e-4 of float64's for every k and across (0, 1)."""
    monkeypatch.setattr(sampling_kernels, "log2", _approximate_log2)
    k = torch.arange(1, 65, dtype=torch.float64)
    spread = torch.linspace(0.001, 0.999, 64, dtype=torch.float64)
    u = torch.cat([1 - k * 2.0**-24, 1 - 2.0**-6 + k * 2.0**-24, 1 - 2.0**-6 - k * 2.0**-24, spread]).float()
    exact = -torch.log2(-torch.log2(u.double()))
    out = {}
    for naive in (True, False):
        out[naive] = torch.empty_like(u)
        _noise_kernel[(1,)](u, out[naive], N=u.numel(), NAIVE=naive)
    assert math.isinf(out[True][0]) or math.isnan(out[True][0])  # the emulation reproduces the hazard
    assert torch.isfinite(out[False]).all()
    assert (out[False].double() - exact).abs().max() < 1e-4
