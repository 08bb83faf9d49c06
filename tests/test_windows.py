"""Sliding windows: every layer's read from its config as transformers decides it (``windows.py``),
and the shared-prefix layout on the windowed families transformers ships, on rows longer than
their windows: the policy's states and the critic's values equal the padded forward's, or the
layout falls back and says why."""

import contextlib
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fastppo.trainer.memory.plan import forward_tokens
from fastppo.trainer.modeling.critic import Critic
from fastppo.trainer.update.batch import response_hidden, response_values
from fastppo.trainer.update.probe import check_shared_prefix
from fastppo.trainer.update.row_layout import SharedPrefix, mask_refusal, model_mask
from fastppo.windows import FLAGGED, FULL, SLIDING, UnknownWindows, layer_windows, smallest_window
from tests.oracles import relative_error
from tests.trainer.runs import config as train_config
from tests.trainer.update.test_probe import batch_of

WINDOW = 4
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MOE = dict(num_local_experts=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32)

# model type -> (its window fields, the attention implementations it offers); every one windows
# at least one layer at WINDOW, shorter than the rows below
FAMILIES = {
    "mistral": ({"sliding_window": WINDOW}, ("sdpa", "eager")),
    "mixtral": ({"sliding_window": WINDOW, **MOE}, ("sdpa", "eager")),
    "phi3": ({"sliding_window": WINDOW}, ("sdpa", "eager")),
    "phimoe": ({"sliding_window": WINDOW, **MOE}, ("sdpa",)),
    "starcoder2": ({"sliding_window": WINDOW}, ("sdpa", "eager")),
    "ministral3": ({"sliding_window": WINDOW}, ("sdpa",)),
    "qwen3_moe": ({"sliding_window": WINDOW, "use_sliding_window": True, **MOE}, ("sdpa",)),
    # some layers windowed, some full: one mask per layer type
    "qwen2": ({"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1}, ("sdpa", "eager")),
    "qwen3": ({"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2}, ("sdpa",)),
    "qwen2_moe": ({"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 3, **MOE}, ("sdpa",)),
    "gemma2": ({"sliding_window": WINDOW}, ("eager",)),
    "gemma3_text": ({"sliding_window": WINDOW, "sliding_window_pattern": 2}, ("sdpa", "eager")),
    "gemma4_text": (
        {
            "sliding_window": WINDOW,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 64,
            "global_head_dim": 16,
        },
        ("sdpa", "eager"),
    ),
    "cohere2": ({"sliding_window": WINDOW, "sliding_window_pattern": 2}, ("sdpa",)),
    "exaone4": ({"sliding_window": WINDOW, "sliding_window_pattern": 2}, ("sdpa",)),
    "olmo3": ({"sliding_window": WINDOW}, ("sdpa",)),
    "ministral": (
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        ("sdpa",),
    ),
    "gpt_oss": ({"sliding_window": WINDOW, **MOE}, ("eager",)),
    "smollm3": ({"sliding_window": WINDOW, "use_sliding_window": True, "no_rope_layer_interval": 2}, ("sdpa",)),
}
# families whose windows a mask of shared prompts cannot carry: the layout falls back, saying so
REFUSED = {
    "llama4_text": ({"attention_chunk_size": WINDOW, **MOE}, "chunked_attention"),
    "gpt_neo": (
        {"attention_types": [[["global", "local"], 1], [["global"], 1]], "window_size": WINDOW, "num_heads": 4},
        "band their attention by column",
    ),
}


def tiny(model_type: str, fields: dict, implementation: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **{**TINY, **fields})
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation=implementation).eval()


def models_of(policy, critic=None):
    precision = SimpleNamespace(compute=None, autocast=contextlib.nullcontext)
    return SimpleNamespace(policy=policy, critic=critic, device=torch.device("cpu"), precision=precision)


def critic_of(policy):
    critic = Critic.from_policy(policy)
    torch.nn.init.normal_(critic.head.weight)  # values that are not all 0
    return critic


def long_rows(prompt: int = 6, response: int = 9):
    """Two prompts of ``prompt`` and half as many tokens with 3 and 2 samples of up to ``response``
    tokens: by default rows up to 15 > WINDOW."""
    generator = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, 64, (n,), generator=generator).tolist()

    first, second = ids(prompt), ids(max(prompt // 2, 1))
    lengths = (response, response * 5 // 9, response * 7 // 9, max(response * 2 // 9, 1), response * 8 // 9)
    rows = [(p, ids(n)) for p, n in zip((first, first, second, first, second), lengths)]
    return batch_of(rows, R=response)


@pytest.mark.parametrize(
    "model_type, implementation", [(family, impl) for family, (_, impls) in FAMILIES.items() for impl in impls]
)
def test_windowed_families_share_the_prompt_and_match_their_padded_rows(model_type, implementation):
    fields, _ = FAMILIES[model_type]
    policy = tiny(model_type, fields, implementation)
    assert smallest_window(policy.config) == WINDOW
    critic = critic_of(policy)
    batch = long_rows()
    longest = int((batch.prompt_lens + batch.lens).max())
    shared, why = check_shared_prefix(models_of(policy, critic), True, longest)
    assert shared is not None, why
    with torch.no_grad():
        for forward in (lambda layout: response_hidden(policy, layout), lambda layout: response_values(critic, layout)):
            units = forward(batch.layout(SharedPrefix(key_cost=0.0)))[batch.mask]
            padded = forward(batch.layout())[batch.mask]
            assert relative_error(units, padded) <= 1e-5


@pytest.mark.parametrize("model_type", REFUSED)
def test_windows_the_masks_cannot_carry_fall_back_to_padded_rows_and_say_why(model_type):
    fields, reason = REFUSED[model_type]
    policy = tiny(model_type, fields, "eager")
    with pytest.raises(UnknownWindows):
        layer_windows(policy.config)
    shared, why = check_shared_prefix(models_of(policy), True, 100)
    assert shared is None and why.startswith(f"the policy ({model_type}): ") and reason in why


@pytest.mark.parametrize("window", [4, 12, 20])
@pytest.mark.parametrize(
    "model_type",
    ["mistral", "mixtral", "phi3", "starcoder2", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3"],
)
def test_a_window_flagged_off_is_read_as_the_family_reads_the_flag(model_type, window):
    """Mistral, Mixtral, Phi-3, Starcoder2 and PhiMoE window by ``sliding_window`` whatever
    ``use_sliding_window`` says (hub checkpoints carry it false); the Qwen families and SmolLM3
    do not window with it off. Either way the shared layout equals the model's own padded forward
    on rows past the window, so the reading is the model's."""
    fields = {**FAMILIES[model_type][0], "sliding_window": window, "use_sliding_window": False}
    policy = tiny(model_type, fields, "sdpa")
    off = model_type in FLAGGED or model_type == "smollm3"  # whose config derives full layer types
    assert layer_windows(policy.config) == ([None] * 3 if off else [window] * 3)
    batch = long_rows(prompt=window, response=window)
    shared, why = check_shared_prefix(models_of(policy), True, int((batch.prompt_lens + batch.lens).max()))
    assert shared is not None, why
    with torch.no_grad():
        units = response_hidden(policy, batch.layout(SharedPrefix(key_cost=0.0)))[batch.mask]
        padded = response_hidden(policy, batch.layout())[batch.mask]
    assert relative_error(units, padded) <= 1e-5


@pytest.mark.parametrize("window", [4, 12, 20])
def test_a_window_the_reader_misses_is_caught_by_the_probe(monkeypatch, window):
    """A window ``windows.py`` reads wrong (here its table made to say Mistral obeys the flag, as
    it once read every family) is still narrowed for the probe, which then sees the model window
    where the units' masks do not: the run takes padded rows, however wide the window against the
    probe's rows."""
    from fastppo import windows

    monkeypatch.setitem(windows.FLAGGED, "mistral", "all")
    policy = tiny("mistral", {"sliding_window": window, "use_sliding_window": False}, "sdpa")
    assert smallest_window(policy.config) is None
    shared, why = check_shared_prefix(models_of(policy), True, 15)
    assert shared is None and "the policy's states with the prompt shared differ" in why
    assert policy.config.sliding_window == window  # restored after the probe


def test_a_critic_s_window_the_reader_misses_is_caught_by_its_own_probe(monkeypatch):
    """The same for the critic beside a policy without windows: its own config is narrowed."""
    from fastppo import windows

    monkeypatch.setitem(windows.FLAGGED, "mistral", "all")
    policy = tiny("llama", {}, "sdpa")
    critic = critic_of(tiny("mistral", {"sliding_window": 20, "use_sliding_window": False}, "sdpa"))
    shared, why = check_shared_prefix(models_of(policy, critic), True, 15)
    assert shared is None and "the critic's states with the prompt shared differ" in why
    assert critic.backbone.config.sliding_window == 20


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma3_text"])
def test_a_window_one_short_of_the_rows_masks_their_first_key(model_type):
    """Rows of WINDOW + 1 positions: the last query's window leaves out key 0, in every windowed
    layer's mask (the others' stays causal)."""
    policy = tiny(model_type, FAMILIES[model_type][0], "sdpa")
    positions = torch.arange(WINDOW + 1)[None]  # (1, L)
    causal = torch.ones(WINDOW + 1, WINDOW + 1, dtype=torch.bool).tril()[None]  # (1, L, L)
    mask = model_mask(policy, causal, positions)
    windowed = mask[SLIDING] if isinstance(mask, dict) else mask  # (1, 1, L, L)
    expected = causal.clone()
    expected[0, WINDOW, 0] = False
    assert torch.equal(windowed[:, 0], expected)
    if isinstance(mask, dict):
        assert torch.equal(mask[FULL][:, 0], causal)


def test_an_eager_critic_beside_an_sdpa_policy_each_read_their_own_mask():
    policy = tiny("qwen2", FAMILIES["qwen2"][0], "sdpa")
    critic = critic_of(tiny("qwen2", FAMILIES["qwen2"][0], "eager"))
    batch = long_rows()
    shared, why = check_shared_prefix(models_of(policy, critic), True, 15)
    assert shared is not None, why
    layout = batch.layout(SharedPrefix(key_cost=0.0))
    assert layout.mask_for(policy)["sliding_attention"].dtype == torch.bool
    assert layout.mask_for(critic.backbone)["sliding_attention"].dtype == torch.float32  # additive
    flash = critic_of(tiny("qwen2", FAMILIES["qwen2"][0], "sdpa"))
    flash.backbone.config._attn_implementation = "flash_attention_2"
    shared, why = check_shared_prefix(models_of(policy, flash), True, 15)
    assert shared is None and why == "the critic's flash_attention_2 attention takes no 4-D mask"


def test_a_window_no_row_reaches_needs_no_mask_of_its_own():
    policy = tiny("qwen2", FAMILIES["qwen2"][0], "sdpa")
    batch = long_rows()
    policy.config.sliding_window = 64  # longer than every row: one mask for all layers
    mask = batch.layout(SharedPrefix(key_cost=0.0)).mask_for(policy)
    assert isinstance(mask, torch.Tensor) and mask.shape[1] == 1


CONFIGS = {
    "mistral": ({"sliding_window": 7}, [7, 7, 7]),
    "mistral, no window": ({"sliding_window": None}, [None] * 3),
    "mistral, flag off": ({"sliding_window": 7, "use_sliding_window": False}, [7, 7, 7]),  # read by Qwen's only
    "smollm3, flag off": ({"sliding_window": 7}, [None] * 3),  # its config derives full layer types
    "smollm3, flag off, sliding types": ({"sliding_window": 7, "layer_types": ["sliding_attention"] * 3}, [7] * 3),
    "qwen2, off": ({"sliding_window": 7}, [None] * 3),
    "qwen2, from layer 1": ({"sliding_window": 7, "use_sliding_window": True, "max_window_layers": 1}, [None, 7, 7]),
    "qwen2_moe, every other below 3": (
        {"sliding_window": 7, "use_sliding_window": True, "max_window_layers": 3},
        [7, None, 7],
    ),
    "gemma3_text, every second": ({"sliding_window": 7, "sliding_window_pattern": 2}, [7, None, 7]),
    "phi3": ({"sliding_window": 7}, [7, 7, 7]),
    "llama": ({}, [None] * 3),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_each_layers_window_is_read_as_transformers_decides_it(name):
    fields, expected = CONFIGS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(name.split(",")[0], **{**TINY, **fields})
    assert layer_windows(config) == expected


@pytest.mark.parametrize(
    "fields, unknown",
    [
        ({"sliding_window": [3, None]}, "lists 2 windows for 3 layers"),
        ({"sliding_window": 0}, "not a positive number"),
        ({"sliding_window": 2.5}, "not a positive number"),
        ({"layer_types": ["full_attention", "linear_attention", "full_attention"]}, "linear_attention"),
        ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "sliding_window is None"),
    ],
)
def test_windows_that_cannot_be_read_are_named(fields, unknown):
    config = SimpleNamespace(num_hidden_layers=3, **fields)
    with pytest.raises(UnknownWindows, match=unknown):
        layer_windows(config)
    assert unknown in mask_refusal(config, 100)


def test_per_layer_windows_the_forward_cannot_tell_apart_refuse_the_shared_masks_once_they_bind():
    config = SimpleNamespace(num_hidden_layers=3, sliding_window=[None, 8, 8])
    assert layer_windows(config) == [None, 8, 8]
    assert mask_refusal(config, 8) is None  # no row reaches the window
    assert "differ from layer to layer" in mask_refusal(config, 9)
    config.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    config.sliding_window = 8
    assert mask_refusal(config, 9) is None  # one mask per layer type


def test_the_plan_lays_out_padded_rows_where_the_run_will(tmp_path):
    config = train_config(tmp_path, samples_per_prompt=4, max_new_tokens=20)
    windowed = AutoConfig.for_model("llama4_text", **{**TINY, **MOE, "attention_chunk_size": WINDOW})
    plain = AutoConfig.for_model("llama", **TINY)
    assert "padded rows" in forward_tokens(config, windowed, 8, 10)[1]
    assert "prompts once" in forward_tokens(config, plain, 8, 10)[1]


def test_the_critic_is_probed_too_and_named_when_it_disagrees():
    fields = FAMILIES["mistral"][0]
    policy, critic = tiny("mistral", fields, "sdpa"), critic_of(tiny("mistral", fields, "sdpa"))
    assert check_shared_prefix(models_of(policy, critic), True, 15)[0] is not None
    forward = critic.backbone.forward  # a backbone that counts positions itself
    critic.backbone.forward = lambda *args, position_ids=None, **kwargs: forward(*args, **kwargs)
    shared, why = check_shared_prefix(models_of(policy, critic), True, 15)
    assert shared is None and why.startswith("the critic's states with the prompt shared differ")
