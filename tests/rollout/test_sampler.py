"""Sampler: greedy equals Hugging Face generate(), log-probs equal a recomputed forward, the draw
follows softmax(logits / T), stopping and padding are exact, and the weights are the live ones."""

import pytest
import torch

import fastppo
from tests.oracles import chi2_critical
from tests.rollout.models import FAMILIES, GENERIC, LLAMA_LIKE, PROMPTS, V, hf_greedy, recomputed_logprobs, tiny


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_hf_generate(family):
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64)
    assert sampler.fast_path == (family != GENERIC)
    rollout = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=())
    for row, prompt in enumerate(PROMPTS):
        assert rollout.response_ids[row].tolist() == hf_greedy(model, prompt, 10), f"row {row}"
    assert rollout.finish_reason == ["length"] * 3 and rollout.response_mask.all()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "gpt_neox", GENERIC])
def test_logprobs_equal_a_recomputed_forward(family):
    model = tiny(family)
    rollout = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64).generate(
        PROMPTS, max_new_tokens=9, temperature=0.7, stop_token_ids=(), seed=1, num_samples_per_prompt=2
    )
    assert rollout.logprobs.dtype == torch.float32
    for row in range(len(rollout.prompt_ids)):
        n = int(rollout.response_lens[row])
        torch.testing.assert_close(
            rollout.logprobs[row, :n], recomputed_logprobs(model, rollout, row, 0.7), rtol=0, atol=1e-4
        )
        assert (rollout.logprobs[row, n:] == 0).all()


@pytest.mark.parametrize("window", [12, 20])
def test_a_mistral_window_flagged_off_is_the_windows_hugging_face_decodes_with(window):
    """Mistral windows by ``sliding_window`` whatever ``use_sliding_window`` says: the lean path's
    greedy tokens and log-probs are Hugging Face's on rows past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    fields = dict(LLAMA_LIKE, sliding_window=window, use_sliding_window=False)
    model = MistralForCausalLM(MistralConfig(**fields)).eval()
    prompts = [list(range(1, 15)), [42, 7]]
    sampler = fastppo.Sampler(model, max_batch_size=4, max_seq_len=64)
    assert sampler.fast_path
    greedy = sampler.generate(prompts, max_new_tokens=24, temperature=0, stop_token_ids=())
    for row, prompt in enumerate(prompts):
        assert greedy.response_ids[row].tolist() == hf_greedy(model, prompt, 24), f"row {row}"
    sampled = sampler.generate(prompts, max_new_tokens=24, temperature=0.7, stop_token_ids=(), seed=3)
    for row in range(len(prompts)):
        expected = recomputed_logprobs(model, sampled, row, 0.7)
        torch.testing.assert_close(sampled.logprobs[row, :24], expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gpt2"])
def test_one_padded_prefill_of_ragged_prompts_changes_nothing(family, monkeypatch):
    """All prompts in one right-padded prefill (lengths 3, 7, 1; Mistral's window 6 < 7): greedy still
    equals generate() and log-probs a recomputed forward, with several samples per prompt."""
    from fastppo.rollout import cached as sampler_module

    monkeypatch.setattr(sampler_module, "PREFILL_PADDING", 100.0)
    assert sampler_module.prefill_groups([len(p) for p in PROMPTS]) == [[2, 0, 1]]
    model = tiny(family)
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64)
    greedy = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=(), num_samples_per_prompt=2)
    for row, prompt in enumerate(PROMPTS):
        expected = hf_greedy(model, prompt, 10)
        assert greedy.response_ids[2 * row].tolist() == expected == greedy.response_ids[2 * row + 1].tolist()
    sampled = sampler.generate(
        PROMPTS, max_new_tokens=9, temperature=0.7, stop_token_ids=(), seed=1, num_samples_per_prompt=2
    )
    for row in range(len(sampled.prompt_ids)):
        n = int(sampled.response_lens[row])
        torch.testing.assert_close(
            sampled.logprobs[row, :n], recomputed_logprobs(model, sampled, row, 0.7), rtol=0, atol=1e-4
        )


def test_prefill_groups_bound_padding_and_size(monkeypatch):
    from fastppo.rollout import cached as sampler_module

    lengths = [10, 11, 12, 40, 9, 41, 100, 10]
    groups = sampler_module.prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) * longest <= 1.25 * sum(lengths[i] for i in group)
    assert [4, 0, 7, 1, 2] in groups and [3, 5] in groups and [6] in groups
    monkeypatch.setattr(sampler_module, "PREFILL_TOKENS", 30)
    assert all(len(g) * max(lengths[i] for i in g) <= 30 or len(g) == 1 for g in sampler_module.prefill_groups(lengths))


def test_sampling_follows_softmax_over_temperature():
    model, prompt, temperature, draws = tiny("llama"), [3, 1, 4], 0.8, 4096
    rollout = fastppo.Sampler(model, max_batch_size=draws, max_seq_len=8).generate(
        [prompt], max_new_tokens=1, temperature=temperature, stop_token_ids=(), num_samples_per_prompt=draws, seed=0
    )
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double() / temperature, -1)
    counts = torch.bincount(rollout.response_ids[:, 0], minlength=V).double()
    expected = probs * draws
    big = expected >= 5  # pool the rare tokens into one bin
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    assert chi2 < chi2_critical(len(observed) - 1), chi2


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (5, 0.3)])
def test_top_k_and_top_p_supports(top_k, top_p):
    model, prompt, temperature = tiny("llama"), [3, 1, 4], 1.3
    rollout = fastppo.Sampler(model, max_batch_size=512, max_seq_len=8).generate(
        [prompt],
        max_new_tokens=1,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=(),
        num_samples_per_prompt=512,
        seed=0,
    )
    with torch.no_grad():
        z = model(torch.tensor([prompt])).logits[0, -1] / temperature
    order = torch.argsort(z, descending=True)
    allowed = set(order[:top_k].tolist()) if top_k else set(range(V))
    probs = torch.softmax(z, -1)[order]
    nucleus = int((torch.cumsum(probs, 0) - probs < top_p).sum())  # tokens whose preceding mass < p
    allowed &= set(order[:nucleus].tolist())
    sampled = set(rollout.response_ids[:, 0].tolist())
    assert sampled <= allowed and len(sampled) > 1


def test_stop_token_is_included_and_nothing_follows():
    model = tiny("llama")
    greedy = hf_greedy(model, PROMPTS[0], 10)
    stop = greedy[3]
    position = greedy.index(stop)
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64)
    rollout = sampler.generate(PROMPTS, max_new_tokens=10, temperature=0, stop_token_ids=[stop], pad_token_id=0)
    assert rollout.finish_reason[0] == "stop"
    assert rollout.response_ids[0, : position + 1].tolist() == greedy[: position + 1]
    assert int(rollout.response_lens[0]) == position + 1
    assert rollout.response_mask[0, : position + 1].all() and not rollout.response_mask[0, position + 1 :].any()
    assert (rollout.response_ids[0, position + 1 :] == 0).all() and (rollout.logprobs[0, position + 1 :] == 0).all()


def test_per_row_max_new_tokens():
    rollout = fastppo.Sampler(tiny("qwen2"), max_batch_size=8, max_seq_len=64).generate(
        PROMPTS, max_new_tokens=[2, 5, 3], temperature=1.0, stop_token_ids=(), seed=0
    )
    assert rollout.response_lens.tolist() == [2, 5, 3] and rollout.response_ids.shape == (3, 5)
    assert rollout.finish_reason == ["length"] * 3
    assert rollout.response_mask.sum(1).tolist() == [2, 5, 3]


def test_gpt2_with_pad_equal_to_eos():
    model = tiny("gpt2")
    eos = hf_greedy(model, PROMPTS[1], 6)[2]
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.generation_config.eos_token_id = eos
    rollout = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64).generate(
        PROMPTS, max_new_tokens=6, temperature=0
    )
    row = rollout.response_ids[1].tolist()
    assert rollout.finish_reason[1] == "stop" and row.index(eos) == int(rollout.response_lens[1]) - 1
    assert rollout.response_mask[1].sum() == row.index(eos) + 1  # the padding after it is not in the mask


def test_samples_of_a_prompt_are_consecutive_and_seeds_reproduce():
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=8, max_seq_len=64)
    greedy = sampler.generate(PROMPTS[:2], max_new_tokens=6, temperature=0, stop_token_ids=(), num_samples_per_prompt=3)
    assert greedy.prompt_ids == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert (greedy.response_ids[:3] == greedy.response_ids[0]).all()
    assert (greedy.response_ids[3:] == greedy.response_ids[3]).all()
    runs = [sampler.generate(PROMPTS, max_new_tokens=8, stop_token_ids=(), seed=s).response_ids for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_rollouts_use_the_live_weights():
    model = tiny("llama")
    model.train()
    sampler = fastppo.Sampler(model, max_batch_size=8, max_seq_len=64)
    before = sampler.generate(PROMPTS, max_new_tokens=6, temperature=0, stop_token_ids=())
    assert model.training  # restored after sampling
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
    model(torch.tensor([PROMPTS[1]])).logits[0, -1, before.response_ids[1, 0]].backward()
    optimizer.step()  # pushes down the token row 1 chose first
    after = sampler.generate(PROMPTS, max_new_tokens=6, temperature=0, stop_token_ids=())
    assert not torch.equal(before.response_ids, after.response_ids)
    model.eval()
    for row in range(3):
        torch.testing.assert_close(after.logprobs[row], recomputed_logprobs(model, after, row, 1.0), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(prompts=[]), "non-empty list"),
        (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
        (dict(prompts=[[1, V]]), r"outside the vocabulary \[0, 97\)"),
        (dict(prompts=[[-1]]), "outside the vocabulary"),
        (dict(max_new_tokens=60), r"exceeds max_seq_len=64"),
        (dict(max_new_tokens=[1, 2]), "2 entries for 1 prompts"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(num_samples_per_prompt=9), "exceeds max_batch_size=8"),
        (dict(temperature=-1.0), "temperature must be"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_k=-2), "top_k must be"),
        (dict(stop_token_ids=[V + 3]), "stop and pad token ids"),
    ],
)
def test_bad_input(kwargs, match):
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=8, max_seq_len=64)
    args = dict(prompts=[[1] * 10], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        sampler.generate(args.pop("prompts"), **args)


@pytest.mark.parametrize("kv_cache", ["static", "paged"])
def test_a_sleeping_sampler_holds_no_kv_memory_and_wakes_to_the_same_rollout(kv_cache):
    """``sleep`` frees the cache for a trainer's update; the next ``generate`` has it back, zeroed,
    and samples what it sampled before."""
    sampler = fastppo.Sampler(tiny("llama"), max_batch_size=4, max_seq_len=32, kv_cache=kv_cache)
    options = dict(max_new_tokens=8, temperature=1.0, seed=5, num_samples_per_prompt=2, stop_token_ids=())
    before = sampler.generate(PROMPTS, **options)
    held = sum(t.untyped_storage().nbytes() for t in sampler.kv_cache.k + sampler.kv_cache.v)
    sampler.sleep()
    sampler.sleep()  # twice is once
    assert held > 0 and all(t.untyped_storage().nbytes() == 0 for t in sampler.kv_cache.k + sampler.kv_cache.v)
    after = sampler.generate(PROMPTS, **options)
    assert sum(t.untyped_storage().nbytes() for t in sampler.kv_cache.k + sampler.kv_cache.v) == held
    assert torch.equal(after.response_ids, before.response_ids) and torch.equal(after.logprobs, before.logprobs)
