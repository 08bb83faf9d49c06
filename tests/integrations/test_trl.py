"""fastppo.integrations.trl against the installed TRL: same values and gradients, and patching.

Each test calls TRL the way the installed version's own code does (CI runs this file with the
newest TRL and again with TRL 1.9); what an older TRL lacks is computed from its own pieces.
"""

import importlib.util
import sys

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils")

import fastppo.integrations.trl as integration  # noqa: E402
from fastppo.integrations.peers import parse_version  # noqa: E402
from tests.oracles import relative_error  # noqa: E402

TRL = integration.TRL
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # TRL's CPU path runs bf16 in bf16


def test_the_installed_trl_is_followed_and_supported():
    assert TRL.installed() in TRL.releases, "CI installs only releases the drop-ins declare"
    assert TRL.check_supported() == TRL.release == TRL.installed()


def inputs(dtype, B=3, T=5, V=41):
    logits = (torch.randn(B, T, V) * 3).to(dtype).requires_grad_()
    index = torch.randint(0, V, (B, T))
    row_mask = torch.rand(B, T) > 0.3
    return logits, index, row_mask


def trl_selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
    """TRL's own selective_log_softmax; before 1.14 (no temperature or row_mask) as its callers did it."""
    if TRL.has("temperature-and-row-mask"):
        return trl_utils.selective_log_softmax(logits, index, temperature=temperature, row_mask=row_mask)
    logp = trl_utils.selective_log_softmax(logits / temperature, index)
    return logp if row_mask is None else logp.masked_fill(row_mask == 0, 0.0)


def trl_head():
    """TRL's chunked LM-head function, under the name the installed version defines it."""
    if TRL.has("head-outputs"):
        return importlib.import_module("trl.kernels").ChunkedLogProbFunction
    return trl_utils._ChunkedLogProbFunction


def head_arguments(hidden, weight, targets, temperature, chunk_size, outputs):
    """The positional arguments the installed TRL passes its chunked LM head."""
    if TRL.has("head-outputs"):
        return hidden, weight, None, targets, temperature, chunk_size, None, 1.0, outputs
    if TRL.has("head-bias"):
        return hidden, weight, None, targets, temperature, chunk_size, None, 1.0
    return hidden, weight, targets, temperature, chunk_size, None, 1.0


def check_same(ours, theirs, leaf, dtype):
    """Same dtype, shape and values; the same gradient of a random linear function of them."""
    rtol, atol = TOL[dtype]
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=rtol, atol=atol)
    weights = torch.randn(ours.shape)
    (g_ours,) = torch.autograd.grad((ours.float() * weights).sum(), leaf, retain_graph=True)
    (g_theirs,) = torch.autograd.grad((theirs.float() * weights).sum(), leaf, retain_graph=True)
    assert relative_error(g_ours, g_theirs) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax(dtype, temperature):
    logits, index, row_mask = inputs(dtype)
    for mask in (None, row_mask):
        ours = integration.selective_log_softmax(logits, index, temperature=temperature, row_mask=mask)
        check_same(ours, trl_selective_log_softmax(logits, index, temperature, mask), logits, dtype)
    check_same(
        integration.selective_log_softmax(logits, index),  # the two-argument call of every version
        trl_utils.selective_log_softmax(logits, index),
        logits,
        dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_entropy_from_logits(dtype):
    logits, _, _ = inputs(dtype)
    check_same(integration.entropy_from_logits(logits), trl_utils.entropy_from_logits(logits), logits, dtype)


@pytest.mark.skipif(
    not TRL.has("temperature-and-row-mask"), reason="selective_log_softmax_and_entropy is new in TRL 1.14"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_selective_log_softmax_and_entropy(dtype):
    logits, index, row_mask = inputs(dtype)
    ours = integration.selective_log_softmax_and_entropy(logits, index, temperature=0.8, row_mask=row_mask)
    theirs = trl_utils.selective_log_softmax_and_entropy(logits, index, temperature=0.8, row_mask=row_mask)
    for a, b in zip(ours, theirs):
        check_same(a, b, logits, dtype)
    _, entropy = integration.selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=False)
    assert not entropy.requires_grad


@pytest.mark.parametrize("temperature,row_mask", [(1.0, False), (0.5, True)])
def test_uncovered_cases_go_to_trl(temperature, row_mask):
    logits = torch.randn(2, 3, 11, dtype=torch.float64)
    index = torch.randint(0, 11, (2, 3, 2))  # two indices per row
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]]).unsqueeze(-1) if row_mask else None
    torch.testing.assert_close(
        integration.selective_log_softmax(logits, index, temperature, mask),
        trl_selective_log_softmax(logits, index, temperature, mask),
    )
    with pytest.raises(ValueError, match="temperature must be positive"):
        integration.selective_log_softmax(logits, index[..., 0], temperature=0.0)


def test_fused_linear_log_prob_matches_trl_chunked_function(monkeypatch):
    N, H, V = 37, 16, 53
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) / 2).requires_grad_()
    targets = torch.randint(0, V, (N,))
    args = head_arguments(hidden, weight, targets, 0.9, 16, ("log_probs", "entropy"))
    asked = []
    real = integration.token_logprobs_from_hidden
    monkeypatch.setattr(
        integration, "token_logprobs_from_hidden", lambda *a, **k: asked.append(k["return_stats"]) or real(*a, **k)
    )
    ours = integration.FusedLinearLogProb.apply(*args)
    assert asked == [False]  # GRPO's outputs: no statistics computed
    theirs = trl_head().apply(*args)
    assert len(ours) == len(theirs) == (5 if TRL.has("head-outputs") else 2)
    assert all(x is None for x in ours[2:]) and all(x is None for x in theirs[2:])
    for a, b in zip(ours[:2], theirs[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    w = torch.randn(N)
    for leaf in (hidden, weight):
        (g_ours,) = torch.autograd.grad(((ours[0] + ours[1]) * w).sum(), leaf, retain_graph=True)
        (g_theirs,) = torch.autograd.grad(((theirs[0] + theirs[1]) * w).sum(), leaf, retain_graph=True)
        assert relative_error(g_ours, g_theirs) <= 1e-5


@pytest.mark.skipif(not TRL.has("head-outputs"), reason="the LM head's extra outputs are new in TRL 1.15")
@pytest.mark.parametrize(
    "outputs",
    [
        ("entropy", "is_top1", "mean_logits"),
        ("log_sum_sq_probs",),
        ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
    ],
)
def test_extra_head_outputs_from_fastppo(monkeypatch, outputs):
    """SFT, DPO and KTO ask the head for these; fastppo computes them in its own pass."""
    monkeypatch.setattr(integration, "_trl", lambda name: pytest.fail(f"fell back to TRL's {name}"))
    N, H, V = 29, 8, 37
    hidden, weight, targets = torch.randn(N, H), torch.randn(V, H), torch.randint(0, V, (N,))
    targets[:3] = (hidden[:3] @ weight.T).argmax(dim=-1)  # some labels are the top-1 token
    args = head_arguments(hidden, weight, targets, 0.8, 8, outputs)
    ours, theirs = integration.FusedLinearLogProb.apply(*args), trl_head().apply(*args)
    assert len(ours) == len(theirs) == 5
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if "is_top1" in outputs:
        assert ours[4][:3].all()


def names_patched():
    """The helpers the installed TRL has, as fastppo patches them."""
    return {
        name: drop_in for (module, name), drop_in in integration._PATCH.replacements.items() if hasattr(trl_utils, name)
    }


def test_patch_routes_trl_through_fastppo_and_unpatch_restores(monkeypatch):
    originals = {name: getattr(trl_utils, name) for name in names_patched()}
    calls = []
    real = integration.token_logprobs
    monkeypatch.setattr(integration, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, index, _ = inputs(torch.float32)
    with integration.patch():
        for name, replacement in names_patched().items():
            assert getattr(trl_utils, name) is replacement
        trl_utils.selective_log_softmax(logits, index)  # called the way TRL's code calls it
        trl_utils.entropy_from_logits(logits)
        assert len(calls) == 2
    for name, original in originals.items():
        assert getattr(trl_utils, name) is original
    trl_utils.selective_log_softmax(logits, index)
    assert len(calls) == 2  # TRL's own again


def test_unpatch_restores_modules_imported_while_patched():
    source = "from trl.trainer.utils import selective_log_softmax, entropy_from_logits\n"
    spec = importlib.util.spec_from_loader("trl.fastppo_probe", loader=None)
    probe = importlib.util.module_from_spec(spec)
    original = trl_utils.selective_log_softmax
    try:
        with integration.patch():
            exec(source, probe.__dict__)  # what a trainer module imported now does
            sys.modules["trl.fastppo_probe"] = probe
            assert probe.selective_log_softmax is integration.selective_log_softmax
        assert probe.selective_log_softmax is original
        assert probe.entropy_from_logits is trl_utils.entropy_from_logits is not integration.entropy_from_logits
    finally:
        sys.modules.pop("trl.fastppo_probe", None)


def test_patch_refuses_a_trl_older_than_supported(monkeypatch):
    monkeypatch.setattr(TRL, "installed", lambda: parse_version("1.8.0"))
    with pytest.raises(ValueError, match=r"trl 1.8.0 is older than fastppo's drop-ins support \(1.9.0 to 1.16.0\)"):
        integration.patch()
    assert not integration._PATCH.active


def test_patch_without_trl_is_a_clear_import_error(monkeypatch):
    import importlib

    real_import = importlib.import_module

    def no_trl(name, *args):
        if name.startswith("trl"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_trl)
    with pytest.raises(ImportError, match="needs trl: pip install trl"):
        integration.patch()


def tiny_model_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )
    )
    return model, tokenizer


def spy_on_fastppo(monkeypatch) -> list:
    """Record each call into fastppo: ``"head"`` (the LM head, with its outputs) or ``"logits"``."""
    calls = []
    real_head, real_logprobs = integration.FusedLinearLogProb.apply, integration.token_logprobs
    monkeypatch.setattr(
        integration.FusedLinearLogProb,
        "apply",
        staticmethod(
            lambda *a, **k: calls.append(("head", a[-1] if TRL.has("head-outputs") else ())) or real_head(*a, **k)
        ),
    )
    monkeypatch.setattr(
        integration, "token_logprobs", lambda *a, **k: calls.append(("logits", ())) or real_logprobs(*a, **k)
    )
    return calls


def test_tiny_grpo_run_goes_through_fastppo(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = tiny_model_and_tokenizer()
    prompts = datasets.Dataset.from_dict({"prompt": ["a b c", "d e", "f g h i", "j"] * 2})
    calls = spy_on_fastppo(monkeypatch)  # GRPO scores through the fused head from TRL 1.15, the logits before
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
    )
    with integration.patch():
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [float(c.count("a")) for c in completions],
            args=args,
            train_dataset=prompts,
            processing_class=tokenizer,
        )
        trainer.train()
    kinds = {kind for kind, _ in calls}
    assert ("head" if TRL.has("head-outputs") else "logits") in kinds, "GRPO did not score completions through fastppo"
    grad_norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    assert len(grad_norms) == 2 and all(torch.isfinite(torch.tensor(g)) for g in grad_norms) and max(grad_norms) > 0


@pytest.mark.skipif(not TRL.has("head-outputs"), reason="SFT scores through the fused LM head from TRL 1.15")
def test_tiny_sft_run_goes_through_fastppo(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = tiny_model_and_tokenizer()
    texts = datasets.Dataset.from_dict({"text": ["a b c d", "e f g", "h i j k l", "m n"] * 2})
    calls = spy_on_fastppo(monkeypatch)
    args = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
        max_length=8,
    )
    with integration.patch():
        trainer = SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tokenizer)
        trainer.train()
    assert any(kind == "head" and "is_top1" in outputs for kind, outputs in calls), calls
    logs = [row for row in trainer.state.log_history if "loss" in row]
    assert len(logs) == 2 and all(0 < row["loss"] < 10 for row in logs)
    assert all(0 <= row["mean_token_accuracy"] <= 1 for row in logs)  # TRL's metric from fastppo's is_top1
