"""fastppo.integrations.trl against the installed TRL: same values and gradients, and patching."""

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils")
trl_kernels = pytest.importorskip("trl.kernels")

import fastppo.integrations.trl as integration  # noqa: E402
from tests.oracles import relative_error  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # TRL's CPU path runs bf16 in bf16


def inputs(dtype, B=3, T=5, V=41):
    logits = (torch.randn(B, T, V) * 3).to(dtype).requires_grad_()
    index = torch.randint(0, V, (B, T))
    row_mask = torch.rand(B, T) > 0.3
    return logits, index, row_mask


def check_same(ours, theirs, leaf, dtype):
    """Same dtype, shape and values; the same gradient of a random linear function of them."""
    rtol, atol = TOL[dtype]
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=rtol, atol=atol)
    weights = torch.randn(ours.shape)
    g_ours, = torch.autograd.grad((ours.float() * weights).sum(), leaf, retain_graph=True)
    g_theirs, = torch.autograd.grad((theirs.float() * weights).sum(), leaf, retain_graph=True)
    assert relative_error(g_ours, g_theirs) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax(dtype, temperature):
    logits, index, row_mask = inputs(dtype)
    for mask in (None, row_mask):
        ours = integration.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
        theirs = trl_utils.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
        check_same(ours, theirs, logits, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_entropy_from_logits(dtype):
    logits, _, _ = inputs(dtype)
    check_same(integration.entropy_from_logits(logits), trl_utils.entropy_from_logits(logits), logits, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_selective_log_softmax_and_entropy(dtype):
    logits, index, row_mask = inputs(dtype)
    ours = integration.selective_log_softmax_and_entropy(logits, index, temperature=0.8, row_mask=row_mask)
    theirs = trl_utils.selective_log_softmax_and_entropy(logits, index, temperature=0.8, row_mask=row_mask)
    for a, b in zip(ours, theirs):
        check_same(a, b, logits, dtype)
    _, entropy = integration.selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=False)
    assert not entropy.requires_grad


def test_uncovered_cases_go_to_trl():
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    index = torch.randint(0, 11, (2, 3, 2))  # two indices per row
    torch.testing.assert_close(integration.selective_log_softmax(logits, index),
                               trl_utils.selective_log_softmax(logits, index))
    with pytest.raises(ValueError, match="temperature must be positive"):
        integration.selective_log_softmax(logits, index[..., 0], temperature=0.0)


def test_fused_linear_log_prob_matches_trl_chunked_function():
    N, H, V = 37, 16, 53
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) / 2).requires_grad_()
    targets = torch.randint(0, V, (N,))
    outputs = ("log_probs", "entropy")
    ours = integration.FusedLinearLogProb.apply(hidden, weight, None, targets, 0.9, 16, None, 1.0, outputs)
    theirs = trl_kernels.ChunkedLogProbFunction.apply(hidden, weight, None, targets, 0.9, 16, None, 1.0, outputs)
    assert all(x is None for x in ours[2:]) and all(x is None for x in theirs[2:])
    for a, b in zip(ours[:2], theirs[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    w = torch.randn(N)
    for leaf in (hidden, weight):
        g_ours, = torch.autograd.grad(((ours[0] + ours[1]) * w).sum(), leaf, retain_graph=True)
        g_theirs, = torch.autograd.grad(((theirs[0] + theirs[1]) * w).sum(), leaf, retain_graph=True)
        assert relative_error(g_ours, g_theirs) <= 1e-5


def test_patch_routes_trl_through_fastppo_and_unpatch_restores(monkeypatch):
    originals = {name: getattr(trl_utils, name) for name in integration._REPLACEMENTS}
    calls = []
    real = integration.token_logprobs
    monkeypatch.setattr(integration, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, index, _ = inputs(torch.float32)
    with integration.patch():
        for name, replacement in integration._REPLACEMENTS.items():
            assert getattr(trl_utils, name) is replacement
        trl_utils.selective_log_softmax(logits, index)  # called the way TRL's code calls it
        trl_utils.selective_log_softmax_and_entropy(logits, index)
        assert len(calls) == 2
    for name, original in originals.items():
        assert getattr(trl_utils, name) is original
    trl_utils.selective_log_softmax(logits, index)
    assert len(calls) == 2  # TRL's own again


def test_patch_without_trl_is_a_clear_import_error(monkeypatch):
    import importlib

    real_import = importlib.import_module

    def no_trl(name, *args):
        if name.startswith("trl"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_trl)
    with pytest.raises(ImportError, match="needs TRL: pip install trl"):
        integration.patch()


def test_tiny_grpo_run_goes_through_fastppo(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=None))
    prompts = datasets.Dataset.from_dict({"prompt": ["a b c", "d e", "f g h i", "j"] * 2})

    calls = []
    real = integration.FusedLinearLogProb.apply
    monkeypatch.setattr(integration.FusedLinearLogProb, "apply",
                        staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=6, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                      save_strategy="no", learning_rate=1e-3)
    with integration.patch():
        trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(c.count("a")) for c in completions],
                              args=args, train_dataset=prompts, processing_class=tokenizer)
        trainer.train()
    assert calls, "GRPO did not score completions through fastppo"
    grad_norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    assert len(grad_norms) == 2 and all(torch.isfinite(torch.tensor(g)) for g in grad_norms) and max(grad_norms) > 0
