"""The kernels at the shapes ``fastppo bench --sass`` reports, launched as their launchers launch them.

Each case is recorded from the real launcher on real tensors (``launches.py``), so it compiles as
the runtime specialises it, as the compile check over every variant does
(``tests/kernels/sm90_compile.py``). Shapes are those of a real RL step on a 150k-vocabulary
model: 8192 tokens of log-probs, a 256-row sampling step, 512 rollouts of 8192 positions for GAE,
and the same 4M tokens for the PPO loss; plus one small vocabulary (1000) for the log-prob
kernels' one-warp tiling; decode attention at Qwen2.5-7B's heads (4 KV heads of 128, 7 query heads
each, bf16), 256 rows of 4k positions, and 64 groups of 8 samples of a 2k-token prompt.
"""

import torch
import triton

from ..kernels import decode_attention, gae, ppo_policy_loss, sample_tokens, token_logprobs
from ..kernels.contract import PARTIALS, Cascade, LossTerms
from ..ops.token_logprobs_from_hidden import HALF_LOGIT_GRAD, WEIGHT_GRAD_IN_PLACE, default_chunk_size
from .launches import launched
from .roofline import KernelCase, from_hidden_model


def _empty(*shape, dtype=torch.float32, device="cpu"):
    # Not initialised: on the CPU never touched (the launcher is recorded, not run); on a GPU the
    # kernel check times the recorded launch on whatever the memory holds.
    return torch.empty(shape, dtype=dtype, device=device)


def logprob_cases(N: int = 8192, V: int = 151936, device="cpu") -> list:
    BLOCK_N, BLOCK_V, warps = token_logprobs._tiling(V, None)
    logits = _empty(1, N, V, dtype=torch.bfloat16, device=device)
    labels = torch.zeros(1, N, dtype=torch.long, device=device)
    logp, entropy, lse = (_empty(N, device=device) for _ in range(3))
    per_trip = dict(trips=triton.cdiv(V, BLOCK_V), elements_per_trip=BLOCK_N * BLOCK_V, target=0.9)
    shape = f"bf16 [{N}, {V}]"
    forward = launched(
        token_logprobs,
        "_logprobs_fwd_kernel",
        lambda: token_logprobs.logprobs_forward(logits, labels, None, 1.0, -100, logp, entropy, lse),
    )
    cases = [KernelCase("token_logprobs forward", shape, forward, bytes=2 * N * V + 20 * N, **per_trip)]
    for g_ent in (False, True):
        grad_entropy = _empty(N, device=device) if g_ent else None
        backward = launched(
            token_logprobs,
            "_logprobs_bwd_kernel",
            lambda grad_entropy=grad_entropy: token_logprobs.logprobs_backward(
                logits, logits, labels, None, 1.0, -100, lse, entropy, logp, grad_entropy
            ),
        )
        name = f"token_logprobs backward{' (+ entropy grad)' if g_ent else ''}"
        cases.append(KernelCase(name, shape, backward, bytes=4 * N * V + (32 if g_ent else 16) * N, **per_trip))
    return cases


def sample_cases(B: int = 256, V: int = 151936, device="cpu", greedy_only: bool = False, splits=None) -> list:
    """The sampling kernel, drawing and greedy, and the combine kernel when the vocabulary is split
    (``splits``: as the launcher picks, or forced)."""
    BLOCK_N, BLOCK_V, warps = sample_tokens._sample_tiling(V, None)
    SPLITS = splits or sample_tokens._splits(B, V, BLOCK_N, BLOCK_V)
    split_cols = triton.cdiv(triton.cdiv(V, SPLITS), BLOCK_V) * BLOCK_V
    logits = _empty(B, V, dtype=torch.bfloat16, device=device)
    tokens, logp = _empty(B, dtype=torch.long, device=device), _empty(B, device=device)
    shape = f"bf16 [{B}, {V}], {SPLITS} splits"
    cases = []
    for greedy in (True,) if greedy_only else (False, True):
        run = lambda greedy=greedy: sample_tokens.sample_forward(logits, 1.0, greedy, 7, tokens, logp, splits=SPLITS)  # noqa: E731
        cases.append(
            KernelCase(
                f"sample_tokens{' (greedy)' if greedy else ''}",
                shape,
                launched(sample_tokens, "_sample_kernel", run),
                trips=triton.cdiv(split_cols, BLOCK_V),
                elements_per_trip=BLOCK_N * BLOCK_V,
                bytes=2 * B * V + 12 * B,
                target=0.75 if greedy else 0.7,
            )
        )
    if SPLITS > 1 and not greedy_only:
        # The splits' partials (m_x, s, best fp32; the column int64) in, a token and its log-prob out,
        # and the chosen logit read again (a 32-byte sector per row).
        run = lambda: sample_tokens.sample_forward(logits, 1.0, False, 7, tokens, logp, splits=SPLITS)  # noqa: E731
        cases.append(
            KernelCase(
                "sample_tokens combine",
                shape,
                launched(sample_tokens, "_combine_kernel", run),
                trips=1,
                elements_per_trip=32 * SPLITS,
                bytes=B * SPLITS * 20 + B * (12 + 32),
            )
        )
    return cases


def gae_cases(B: int = 512, T: int = 8192, device="cpu") -> list:
    BLOCK_B, BLOCK_T, warps = gae._tiling(B, T, None)
    per_element = 4 + 4 + 1 + 4 + 4  # rewards, values, mask in; advantages, returns out
    rewards, values, advantages, returns = (_empty(B, T, device=device) for _ in range(4))
    mask = _empty(B, T, dtype=torch.bool, device=device)
    launch = launched(gae, "_gae_kernel", lambda: gae.gae(rewards, values, mask, 1.0, 0.95, advantages, returns))
    return [
        KernelCase(
            "gae",
            f"fp32 [{B}, {T}]",
            launch,
            trips=triton.cdiv(T, BLOCK_T),
            elements_per_trip=BLOCK_B * BLOCK_T,
            bytes=per_element * B * T,
            target=0.6,
        )
    ]


def ppo_loss_cases(N: int = 512 * 8192, device="cpu") -> list:
    tokens = [_empty(N, device=device) for _ in range(6)]  # logp, old, advantages, weights, ref, entropy
    valid, grad = _empty(N, dtype=torch.bool, device=device), _empty(N, device=device)
    partials = _empty(ppo_policy_loss.num_programs(N), len(PARTIALS), device=device)
    terms = LossTerms(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.01, kl_estimator=3, entropy_coef=0.01)
    launch = launched(
        ppo_policy_loss,
        "_ppo_loss_fwd_kernel",
        lambda: ppo_policy_loss.ppo_loss_forward(*tokens[:4], valid, *tokens[4:], terms, grad, partials),
    )
    read = 4 * 6 + 1  # logp, old, advantages, weights, ref, entropy; valid
    return [
        KernelCase(
            "ppo_loss forward (ref k3, entropy, dual clip)",
            f"fp32 [{N}]",
            launch,
            trips=1,
            elements_per_trip=ppo_policy_loss._BLOCK,
            bytes=(read + 4) * N,
            target=0.85,
        )
    ]


# Qwen2.5-7B's attention: layers, KV heads, query heads per KV head, head size; a bf16 cache in blocks of 16.
QWEN7B = dict(layers=28, kv_heads=4, group=7, head_dim=128)
DECODE_PAGE = 16


def _decode_tensors(rows: int, positions: int, device, kv_heads, group, head_dim, **_):
    """A step's query and output, and a pool holding ``rows`` rows of ``positions`` each, its table."""
    per_row = triton.cdiv(positions, DECODE_PAGE)
    q = _empty(rows, kv_heads * group, head_dim, dtype=torch.bfloat16, device=device)
    pool = [_empty(1 + rows * per_row, DECODE_PAGE, kv_heads, head_dim, dtype=torch.bfloat16, device=device)]
    pool.append(torch.empty_like(pool[0]))
    table = torch.zeros(rows, per_row, dtype=torch.int32, device=device)
    lengths = torch.full((rows,), positions, dtype=torch.long, device=device)
    return q, pool, table, lengths, torch.empty_like(q)


def decode_attention_cases(rows=256, positions=4096, groups=64, samples=8, prompt=2048, device="cpu", shape=QWEN7B):
    """Decode attention, one layer: ``rows`` rows of ``positions`` keys (plain), and ``groups`` x
    ``samples`` rows of a shared ``prompt`` and ``positions - prompt`` keys each (cascade: the prefix
    kernel, each row's own keys, the combine). Bytes: the keys and values each kernel must read
    (a head of a position: 2 x head_dim x 2 bytes, K and V), the queries, outputs and partials."""
    KVH, G, D = shape["kv_heads"], shape["group"], shape["head_dim"]
    H, position_bytes = KVH * G, 2 * KVH * D * 2
    BLOCK_D, BLOCK_N = decode_attention._tiling(D, torch.bfloat16)
    q, (k, v), table, lengths, out = _decode_tensors(rows, positions, device, **shape)
    S = decode_attention._splits(rows * KVH, positions, BLOCK_N, decode_attention.SMS_WITHOUT_GPU)

    def run():
        decode_attention.decode_attention(q, k, v, table, None, lengths, positions, 0.088, None, None, None, None, out)

    cases = [
        KernelCase(
            "decode_attention",
            f"bf16 {rows} rows x {positions} keys, {S} split(s)",
            launched(decode_attention, "_decode_kernel", run),
            trips=triton.cdiv(triton.cdiv(positions, S), BLOCK_N),
            elements_per_trip=BLOCK_N * BLOCK_D,
            bytes=rows * positions * position_bytes + 2 * rows * H * D * 2,
            target=0.8,
        )
    ]
    B = groups * samples
    q, (k, v), table, lengths, out = _decode_tensors(B, positions, device, **shape)
    members = torch.arange(B, dtype=torch.int32, device=device).view(groups, samples)
    shared = torch.full((groups,), prompt, dtype=torch.int32, device=device)
    cascade = Cascade(members, shared, torch.full((B,), prompt, dtype=torch.int32, device=device), prompt)
    SP = decode_attention._splits(groups * KVH, prompt, BLOCK_N, decode_attention.SMS_WITHOUT_GPU)
    S = decode_attention._splits(B * KVH, positions, BLOCK_N, decode_attention.SMS_WITHOUT_GPU)
    partial_bytes = B * H * (D + 2) * 4  # one split's (m, l, acc) of every row and head

    def run_cascade():
        decode_attention.decode_attention(
            q, k, v, table, None, lengths, positions, 0.088, None, None, None, cascade, out
        )

    shape_name = f"bf16 {groups} x {samples} rows, {prompt} shared + {positions - prompt} own keys"
    own = positions - prompt
    cases += [
        KernelCase(
            "decode_attention cascade: shared prefix",
            f"{shape_name}, {SP} split(s)",
            launched(decode_attention, "_prefix_kernel", run_cascade),
            trips=triton.cdiv(triton.cdiv(prompt, SP), BLOCK_N),
            elements_per_trip=BLOCK_N * BLOCK_D,
            bytes=groups * prompt * position_bytes + B * H * D * 2 + SP * partial_bytes,
        ),
        KernelCase(
            "decode_attention cascade: own keys",
            f"{shape_name}, {S} split(s)",
            launched(decode_attention, "_decode_kernel", run_cascade),
            trips=triton.cdiv(own, BLOCK_N),  # a row's own keys lie in its first split
            elements_per_trip=BLOCK_N * BLOCK_D,
            bytes=B * own * position_bytes + B * H * D * 2 + S * partial_bytes,
        ),
        KernelCase(
            "decode_attention cascade: combine",
            f"{shape_name}, {SP + S} partials",
            launched(decode_attention, "_combine_kernel", run_cascade),
            trips=SP + S,
            elements_per_trip=16 * BLOCK_D,
            bytes=(SP + S) * partial_bytes + B * H * D * 2,
        ),
    ]
    return cases


def decode_step_bytes(rows=256, positions=4096, groups=64, samples=8, prompt=2048, shape=QWEN7B) -> list:
    """Keys and values read per decode step (all layers) by each way of attending, at the shapes of
    :func:`decode_attention_cases`: the kernel (each row's live keys once), the cascade (a group's
    prompt once), and the gather it replaces on CUDA without flash-attn (each row's blocks read and
    written into a new tensor, which SDPA reads again over the longest row's span: 3x, at equal
    lengths no padding)."""
    position_bytes = 2 * shape["kv_heads"] * shape["head_dim"] * 2 * shape["layers"]
    B = groups * samples
    return [
        {
            "workload": f"{rows} rows x {positions} keys",
            "kernel": rows * positions * position_bytes,
            "cascade": None,
            "gather": 3 * rows * positions * position_bytes,
        },
        {
            "workload": f"{groups} x {samples} rows of a {prompt}-token prompt, {positions} keys each",
            "kernel": B * positions * position_bytes,
            "cascade": (groups * prompt + B * (positions - prompt)) * position_bytes,
            "gather": 3 * B * positions * position_bytes,
            "prompt_share": groups / B,  # the cascade's prompt bytes over the plain kernel's
        },
    ]


def all_cases(device="cpu", toy: bool = False) -> list:
    """Every case, its tensors on ``device``; ``toy``: at shapes the Triton interpreter runs in a
    second (the kernel check's dry run), the reported shapes otherwise. Besides the real step's
    shapes: GPT-2's odd vocabulary (50,257: rows between 16-byte vectors), and greedy sampling at
    330 rows, two whole waves where 256 rows fill one and a half (the same predicted time)."""
    N, V, odd_V, rows = (16, 4096, 4097, 64) if toy else (8192, 151936, 50257, 65536)
    return (
        logprob_cases(N, V, device)
        + logprob_cases(rows, 1000, device)[:1]  # the one-warp tiling
        + logprob_cases(N, odd_V, device)
        + sample_cases(8 if toy else 256, 16384 if toy else V, device)  # toy: 2 splits, so a combine
        + sample_cases(10 if toy else 330, V, device, greedy_only=True)
        + sample_cases(8 if toy else 256, odd_V, device)
        + gae_cases(*((4, 256) if toy else (512, 8192)), device)
        + ppo_loss_cases(4096 if toy else 512 * 8192, device)
        + (decode_attention_cases(4, 64, 2, 2, 32, device) if toy else decode_attention_cases(device=device))
    )


def from_hidden_plans(gpu, N: int = 8192, H: int = 4096, V: int = 151936) -> list:
    """The FLOP/byte model of the ops from hidden states at a 7B head: for each op, the launcher's
    plan on CUDA first (marked), then the plan before it (256-row chunks, an fp32 gradient then a
    cast, += per chunk) and one between."""
    default = (default_chunk_size(N, V, "cuda"), WEIGHT_GRAD_IN_PLACE, HALF_LOGIT_GRAD)
    plans = [default] + [p for p in ((256, False, False), (256, True, True), (1024, True, True)) if p != default]
    return [
        {**from_hidden_model(gpu, N, H, V, *plan, recompute=recompute), "default": plan == default}
        for recompute in (False, True)
        for plan in plans
    ]
