"""``fastppo train --plan``: exact where it counts tensors, close to the measured peak overall, from
a config alone."""

import json
import sys
from pathlib import Path

import pytest

from fastppo.bench.measure import LiveBytes
from fastppo.cli import main as fastppo_main
from fastppo.trainer import PPOTrainer
from fastppo.trainer.memory.plan import HOST, ROLLOUT, UPDATE, memory_plan, peak, phases
from fastppo.trainer.modeling.default import char_tokenizer, tiny_policy
from tests.trainer.runs import config

CONFIGS = Path(__file__).resolve().parents[3] / "bench" / "configs"


def planned_and_measured(tmp_path, **fields):
    """The plan's lines, the trainer after two iterations, and the peak bytes it allocated."""
    cfg = config(tmp_path, task="vowels", prompts_per_iteration=8, samples_per_prompt=4, save=False, **fields)
    tokenizer = char_tokenizer()
    with LiveBytes() as mode:
        trainer = PPOTrainer(cfg, policy=tiny_policy(tokenizer, seed=0), tokenizer=tokenizer)
        trainer.iteration(0)
        trainer.iteration(1)
    longest = max(len(ids) for ids in trainer.prompts.ids)
    lines = memory_plan(cfg, trainer.policy.config, prompt_tokens=longest, device_type="cpu")
    return {line.name: line.bytes for line in lines}, trainer, mode.peak, lines


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"lora_rank": 4},
        {"estimator": "gae"},
        {"kl_coef": 0.1, "rollout_dtype": "bf16"},
        {"rollout_batch_size": 12},
        {"rollout_kv_memory": 0.0005, "rollout_kv_block_size": 4},
    ],
)
def test_weights_gradients_and_optimizer_state_are_exact(tmp_path, fields):
    plan, trainer, _, _ = planned_and_measured(tmp_path, **fields)
    policy = list(trainer.policy.parameters())
    assert plan["policy weights"] == nbytes(policy)
    assert plan["gradients"] == nbytes(p.grad for p in policy if p.grad is not None)
    state = [t for s in trainer.optimizers.policy.state.values() for t in s.values()]
    assert plan["AdamW state"] == nbytes(state)
    if trainer.critic is not None:
        critic = list(trainer.critic.parameters())
        critic_state = [t for s in trainer.optimizers.critic.state.values() for t in s.values()]
        assert plan["critic + its gradients and AdamW state"] == nbytes(critic) + nbytes(
            p.grad for p in critic
        ) + nbytes(critic_state)
    if trainer.models.reference is not None and trainer.models.lora is None:
        assert plan["reference"] == nbytes(trainer.models.reference.parameters())
    if not trainer.models.rollout_weights.shared:
        assert plan["rollout copy"] == nbytes(trainer.models.rollout_weights.model.parameters())
    assert plan["KV cache"] == nbytes(trainer.rollouts.sampler.cached.cache.k + trainer.rollouts.sampler.cached.cache.v)


@pytest.mark.parametrize("fields", [{}, {"gradient_checkpointing": True}, {"estimator": "gae"}, {"lora_rank": 4}])
def test_the_peak_is_within_a_quarter_of_the_measured_peak(tmp_path, fields):
    _, _, measured, lines = planned_and_measured(tmp_path, **fields)
    assert 0.75 * measured <= peak(lines) <= 1.25 * measured, (peak(lines), measured)


def test_checkpointing_and_lora_shrink_the_plan():
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(CONFIGS / "qwen2.5-7b")
    fields = dict(prompts_per_iteration=8, samples_per_prompt=8, max_new_tokens=1536)
    totals = {}
    for name, extra in {
        "full": {},
        "checkpointing": {"gradient_checkpointing": True},
        "lora": {"lora_rank": 64, "gradient_checkpointing": True},
    }.items():
        cfg = config(Path("/unused"), **fields, **extra)
        plan = memory_plan(cfg, qwen, prompt_tokens=512, device_type="cuda")
        lines = {line.name: line for line in plan}
        totals[name] = peak(plan)
        if name == "full":
            assert "7,615,616,512 fp32" in lines["policy weights"].how  # Qwen2.5-7B's published 7.62B
            assert lines["rollout copy"].bytes == 2 * 7_615_616_512
    assert totals["lora"] < totals["checkpointing"] < totals["full"]


def test_the_kv_line_counts_the_rows_in_flight_static_and_paged():
    """The issue's shape: Qwen2.5-7B, 64 x 8 rows of a 1,024-token prompt and 8,192 new tokens, in
    100 GiB of KV: a static slot per row at the cap (9,216 positions) against blocks as rows grow."""
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(CONFIGS / "qwen2.5-7b")
    fields = dict(prompts_per_iteration=64, samples_per_prompt=8, max_new_tokens=8192, rollout_kv_block_size=256)
    cfg = config(Path("/unused"), **fields)
    plan = memory_plan(
        cfg, qwen, prompt_tokens=1024, device_type="cuda", kv_memory=100 << 30, mean_response_tokens=1024
    )
    kv = next(line for line in plan if line.name == "KV cache")
    position = 2 * 28 * 512 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16: 57,344 bytes
    assert f"{position:,} B a position" in kv.how and "36 blocks at the cap (9,216)" in kv.how
    static = (100 << 30) // (9216 * position)
    assert f"rows in flight it allows: {static} static" in kv.how  # 203 of the 512
    # a group: its 4 prompt blocks once, 8 samples of ceil((0 + 1,024 + 16) / 256) = 5 blocks
    groups = ((100 << 30) // (256 * position) - 1 - 36) // (4 + 8 * 5)
    assert f"~{8 * groups:,} paged (the sampler takes 512)" in kv.how and 8 * groups > 2 * static
    assert kv.bytes <= 100 << 30


@pytest.mark.parametrize("gib", ["1e-6", "1e-12"])  # 1e-12 GiB is a thousandth of a byte
def test_a_kv_budget_too_small_is_one_line_naming_the_option(tmp_path, capsys, gib):
    args = ["train", "--out", str(tmp_path / "run"), "--iterations", "1", "--rollout-kv-memory", gib]
    assert fastppo_main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading bar
    assert last.startswith(f"fastppo train: error: --rollout-kv-memory {float(gib):g} is too small")
    assert "smallest that works is" in last


def test_a_resume_refuses_a_kv_budget_too_small_before_saying_it_continues_inexactly(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert fastppo_main(["train", "--out", run, "--iterations", "1", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert fastppo_main(["train", "--resume", run, "--iterations", "2", "--rollout-kv-memory", "1e-12"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("fastppo train: error: --rollout-kv-memory 1e-12 is too small")
    assert "not exactly" not in err


def test_fsdp_divides_what_is_sharded_by_the_world_size_and_adds_what_is_gathered():
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(CONFIGS / "qwen2.5-7b")
    fields = dict(prompts_per_iteration=8, samples_per_prompt=8, max_new_tokens=1024, estimator="gae", kl_coef=0.02)
    plans = {
        name: {
            line.name: line
            for line in memory_plan(
                config(Path("/unused"), **fields, **extra), qwen, prompt_tokens=512, device_type="cuda", world_size=8
            )
        }
        for name, extra in {
            "ddp": {},
            "fsdp": {"fsdp": True},
            "fsdp kept": {"fsdp": True, "fsdp_reshard_after_forward": False},
        }.items()
    }
    ddp, fsdp = plans["ddp"], plans["fsdp"]
    for name in ("policy weights", "gradients", "reference"):
        assert fsdp[name].bytes == ddp[name].bytes // 8
    assert fsdp["AdamW state"].bytes < ddp["AdamW state"].bytes / 7  # the step counters stay whole
    assert "gradient all-reduce bucket" in ddp and "gradient all-reduce bucket" not in fsdp
    assert fsdp["rollout copy"].bytes == ddp["rollout copy"].bytes and "rollout only" in fsdp["rollout copy"].how
    # every block gathered through the backward instead of one at a time
    block = 2 * 233_057_920  # one of Qwen2.5-7B's 28 blocks in bf16
    assert plans["fsdp kept"]["gathered weights"].bytes - fsdp["gathered weights"].bytes == 27 * block


def test_the_command_prints_a_plan_and_trains_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    # the plan counts this process's resident memory, which a long test session grows past 1 GiB
    assert fastppo_main(["train", "--plan", "--out", str(out), "--plan-device-memory", "16"]) == 0
    printed = capsys.readouterr().out
    assert "policy weights" in printed and "activations" in printed and "fits" in printed
    assert not out.exists()


def test_a_config_without_a_tokenizer_needs_the_prompt_length(tmp_path, capsys):
    model = CONFIGS / "qwen2.5-1.5b"
    assert fastppo_main(["train", "--plan", "--model", str(model)]) == 2
    assert "--plan-prompt-tokens" in capsys.readouterr().err
    assert (
        fastppo_main(
            [
                "train",
                "--plan",
                "--model",
                str(model),
                "--plan-prompt-tokens",
                "256",
                "--plan-device-memory",
                "8",
                "--device",
                "cuda",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "1,543,714,304 fp32 master weights" in printed and "does NOT fit" in printed
    assert json.loads((model / "config.json").read_text())["model_type"] == "qwen2"


def test_a_plan_that_does_not_fit_names_what_would(capsys):
    argv = [
        "train",
        "--plan",
        "--model",
        str(CONFIGS / "qwen2.5-1.5b"),
        "--plan-prompt-tokens",
        "256",
        "--device",
        "cuda",
    ]
    assert fastppo_main([*argv, "--plan-device-memory", "33"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("  it would fit with: --gradient-checkpointing (") and "--minibatches 4" in last
    # the activations that fit the update (beside a KV cache of every slot at the cap and the packed rollout copy)
    assert "or --max-tokens-per-microbatch 589 (33.00 GiB)" in last
    assert fastppo_main([*argv, "--plan-device-memory", "1"]) == 0
    printed = capsys.readouterr().out
    assert (
        "none of --gradient-checkpointing, LoRA, smaller minibatches, --fsdp, --rollout-tp and --fsdp-offload"
        in printed
    )
    assert "fits it, nor 16 ranks: a larger device" in printed
    assert fastppo_main([*argv, "--plan-device-memory", "200"]) == 0
    assert "would fit" not in capsys.readouterr().out


def test_a_model_without_a_tokenizer_is_said_so(capsys):
    assert fastppo_main(["train", "--plan", "--model", str(CONFIGS / "qwen2.5-1.5b")]) == 2
    assert "has no tokenizer to measure the prompts with; give --plan-prompt-tokens" in capsys.readouterr().err


def test_a_cpu_plan_counts_the_process_itself(capsys):
    argv = ["train", "--plan", "--model", str(CONFIGS / "qwen2.5-1.5b"), "--plan-prompt-tokens", "64"]
    assert fastppo_main([*argv, "--device", "cpu"]) == 0
    runtime = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("runtime")]
    assert len(runtime) == 1 and 0.05 < float(runtime[0].split()[1]) < 4  # GiB: Python, torch, transformers
    assert fastppo_main([*argv, "--device", "cuda"]) == 0
    assert "runtime" not in capsys.readouterr().out  # a GPU's memory holds tensors only


MEASURE = """
import re, sys, torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from fastppo.trainer.modeling.host_memory import release_freed_memory

if sys.argv[1] == "release":
    assert release_freed_memory()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=4000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear"))
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()

def status(field):  # KiB
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

open("/proc/self/clear_refs", "w").write("5")  # the peak so far (building the model, imports) set back to now
before = status("VmRSS")
for step in range(3):  # responses of growing lengths, as iterations bring
    ids = torch.randint(0, 4000, (16, 150 + 20 * step))
    model(input_ids=ids, labels=ids).loss.backward()
print((status("VmHWM") - before) / 1024)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and Linux's peak-RSS reset")
def test_returning_freed_memory_cuts_the_peak_of_a_lora_update():
    """Measured on the process, not on tensors: the peak resident memory a LoRA update adds, with
    glibc's default (its heap keeps what tensors free) and with freed memory returned at once."""
    import subprocess

    growth = {
        mode: float(
            subprocess.run(
                [sys.executable, "-c", MEASURE, mode], capture_output=True, text=True, check=True
            ).stdout.split()[-1]
        )
        for mode in ("default", "release")
    }
    assert growth["release"] < 0.7 * growth["default"], growth


@pytest.mark.parametrize(
    "fields,choice",
    [
        ({"lora_rank": 4}, "release"),
        ({}, "keep"),
        ({"cpu_release_memory": True}, "release"),
        ({"lora_rank": 4, "cpu_release_memory": False}, "keep"),
    ],
)
def test_a_cpu_run_returns_freed_memory_when_it_is_lora_and_keeps_it_otherwise(tmp_path, heap_choices, fields, choice):
    tokenizer = char_tokenizer()
    PPOTrainer(config(tmp_path, task="vowels", **fields), policy=tiny_policy(tokenizer, seed=0), tokenizer=tokenizer)
    assert heap_choices == [choice]


def saved_bytes(attention, *tensors) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``attention(*tensors)``, its inputs
    among them where it keeps them (the split keeps gathered copies instead)."""
    import torch

    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        attention(*(t * 1 for t in tensors))  # inputs as the rotary gives them: not leaves
    return sum(storages.values())


def test_the_split_attention_keeps_about_what_the_plan_counts_for_it(tmp_path):
    """Beyond the dense masked attention, the update's split attention keeps each response's copy of its
    prompt's keys and values for the backward (less the dense mask, plus its gathered queries and
    outputs): the plan counts those copies per block, the rest within the bounds here."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig

    from fastppo.trainer.memory.plan import prompt_copies
    from fastppo.trainer.update.unit_attention import plan_units, split_attention

    heads, kv_heads, head_dim, prompt, samples, response = 9, 3, 64, 120, 8, 40
    model_config = LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads)
    cfg = config(tmp_path, task="vowels", prompts_per_iteration=2, samples_per_prompt=samples, max_new_tokens=response)
    copies = prompt_copies(cfg, model_config, 2 * samples, prompt)
    assert copies == 2 * samples * prompt
    L = prompt + samples * response  # two units, one a row
    units = [(r * L, prompt) for r in range(2)]
    responses = [(r * L + prompt + s * response, response, r) for r in range(2) for s in range(samples)]
    plan = plan_units(units, responses, 2, L, "cpu")
    q, k, v = (torch.randn(2, h, L, head_dim, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    allowed = torch.ones(2, 1, L, L, dtype=torch.bool).tril()  # the dense mask's size is what matters here

    def dense(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)

    extra = saved_bytes(lambda q, k, v: split_attention(q, k, v, plan, None), q, k, v) - saved_bytes(dense, q, k, v)
    counted = 2 * kv_heads * head_dim * copies * 4  # fp32
    assert 0.6 * counted <= extra <= 1.4 * counted, (extra, counted)


def test_the_shared_prefix_and_a_micro_batch_budget_shrink_the_activations_and_the_budget_is_what_fits():
    from transformers import AutoConfig

    from fastppo.limits import GiB
    from fastppo.trainer.memory.plan import fitting_microbatch

    qwen = AutoConfig.from_pretrained(CONFIGS / "qwen2.5-1.5b")
    fields = dict(prompts_per_iteration=8, samples_per_prompt=8, max_new_tokens=256)

    def plan(**extra):
        lines = memory_plan(config(Path("/unused"), **fields, **extra), qwen, prompt_tokens=1024, device_type="cuda")
        return {line.name: line for line in lines}

    shared, padded = plan(), plan(shared_prefix=False)
    # 64 rows of 1024 + 256 padded; 8 prompts once + 64 responses of 256 shared
    assert "81,920 tokens per forward (64 padded rows)" in padded["activations"].how
    assert "24,576 tokens per forward (8 prompts once, 64 responses)" in shared["activations"].how
    # the blocks in proportion to their tokens, plus each response's copy of its prompt's keys and values
    # (28 layers x K,V x 256 x 64 responses x 1024 positions in bf16) that the split attention keeps
    assert "(65,536 positions a block)" in shared["activations"].how
    copies = 28 * 2 * 256 * 65_536 * 2
    assert (shared["activations"].bytes - copies) * 81_920 == padded["activations"].bytes * 24_576
    available = peak(list(shared.values())) - 10 * GiB  # the update's peak, here
    budget = fitting_microbatch(
        config(Path("/unused"), **fields), qwen, prompt_tokens=1024, device_type="cuda", available=available
    )
    assert 1280 <= budget < 24_576
    fitted = plan(max_tokens_per_microbatch=budget)
    assert f"micro-batches of <= {budget:,} tokens" in fitted["activations"].how
    assert available - GiB / 100 < peak(list(fitted.values())) <= available
    assert (
        fitting_microbatch(
            config(Path("/unused"), **fields),
            qwen,
            prompt_tokens=1024,
            device_type="cuda",
            available=available + 10 * GiB,
        )
        is None
    )


def test_the_plan_counts_the_batches_in_flight_and_the_held_out_cache(tmp_path, capsys):
    argv = ["train", "--plan", "--out", str(tmp_path / "run"), "--plan-device-memory", "16", "--max-staleness", "2"]
    assert fastppo_main(argv) == 0
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "rollouts in flight" in line)
    assert "3 batches of 128 rows x 9 tokens" in line and "--max-staleness 2" in line
    assert "held-out KV cache" in printed
    assert fastppo_main([*argv[:-2], "--max-staleness", "0"]) == 0
    assert "in flight" not in capsys.readouterr().out


#: The workload of a user with GPUs of 80 GB: GRPO, 4 prompts x 8 samples per rank, 512-token prompts,
#: 1,024 new tokens, 4 minibatches, gradient checkpointing, sharded.
AT_SCALE = dict(
    estimator="grpo",
    prompts_per_iteration=4,
    samples_per_prompt=8,
    max_new_tokens=1024,
    minibatches=4,
    grad_accumulation=4,
    gradient_checkpointing=True,
    fsdp=True,
)


def _scale_plan(model: str, world: int, **extra) -> list:
    from transformers import AutoConfig

    cfg = config(Path("/unused"), **AT_SCALE, **extra)
    model_config = AutoConfig.from_pretrained(CONFIGS / model)
    return memory_plan(cfg, model_config, prompt_tokens=512, device_type="cuda", world_size=world)


@pytest.mark.parametrize(
    "model, world, extra",
    [
        ("qwen2.5-72b", 8, {"lora_rank": 64, "rollout_tp": 8}),
        ("qwen2.5-72b", 32, {"rollout_tp": 8}),
        ("qwen2.5-32b", 8, {"rollout_tp": 8, "max_tokens_per_microbatch": 4096}),
        ("mistral-nemo-12b", 8, {}),
    ],
)
def test_models_larger_than_a_gpu_fit_80_gb_each_phase_and_the_start_up_too(model, world, extra):
    lines = _scale_plan(model, world, **extra)
    by_phase = phases(lines)
    assert peak(lines) <= 80 << 30, {k: v / 2**30 for k, v in by_phase.items()}
    assert peak(lines) == max(by_phase.values()) and by_phase["start-up"] < by_phase[UPDATE]


def test_the_whole_rollout_copy_is_what_keeps_72b_off_8_gpus_and_rollout_tp_splits_it():
    whole = {line.name: line for line in _scale_plan("qwen2.5-72b", 8, lora_rank=64)}
    split = {line.name: line for line in _scale_plan("qwen2.5-72b", 8, lora_rank=64, rollout_tp=8)}
    params = 72_706_203_648  # Qwen2.5-72B's published 72.7B
    assert whole["rollout copy"].bytes == 2 * params and split["rollout copy"].bytes == 2 * params // 8
    assert whole["rollout copy"].when == split["rollout copy"].when == ROLLOUT
    # a group of 8 decodes its ranks' rows together, each rank 1/8 of every position's heads
    assert "40,960 B a position" in split["KV cache"].how and "256 slots" in split["KV cache"].how
    assert split["KV cache"].bytes == whole["KV cache"].bytes
    assert peak(list(whole.values())) > 80 << 30 >= peak(list(split.values()))


def test_the_phases_hold_their_own_lines_and_offload_moves_the_trained_state_to_the_host():
    plain = {line.name: line for line in _scale_plan("qwen2.5-32b", 8, rollout_tp=8)}
    assert plain["activations"].when == plain["loss head"].when == plain["gathered weights"].when == UPDATE
    assert plain["gradients"].when == UPDATE and plain["KV cache"].when == ROLLOUT
    offloaded = _scale_plan("qwen2.5-32b", 8, rollout_tp=8, fsdp_offload=True, device="cuda")
    host = {line.name for line in offloaded if line.when == HOST}
    assert host == {"policy weights", "gradients", "AdamW state"}
    moved = sum(plain[name].bytes for name in host)
    assert phases(offloaded)[HOST] == moved
    assert phases(offloaded)[UPDATE] == phases(list(plain.values()))[UPDATE] - moved


def test_kv_heads_fewer_than_the_ranks_are_each_cached_on_several():
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(CONFIGS / "qwen2.5-1.5b")  # 12 heads, 2 KV heads of 128
    cfg = config(Path("/unused"), fsdp=True, rollout_tp=4)
    plan = memory_plan(cfg, qwen, prompt_tokens=64, device_type="cuda", world_size=4)
    (kv,) = [line for line in plan if line.name == "KV cache"]
    assert "(28 layers x K,V x 128, each KV head on 2 of the 4 ranks)" in kv.how


def test_a_run_on_one_device_keeps_its_kv_cache_through_the_update():
    from transformers import AutoConfig

    qwen = AutoConfig.from_pretrained(CONFIGS / "qwen2.5-7b")
    lines = {
        line.name: line for line in memory_plan(config(Path("/unused")), qwen, prompt_tokens=256, device_type="cuda")
    }
    assert lines["KV cache"].when == "held"  # its CUDA graphs read it


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--rollout-tp", "3"], "--rollout-tp 3 does not divide the 8 ranks planned"),
        (
            ["--rollout-tp", "8", "--model", str(CONFIGS / "qwen2.5-1.5b")],
            "qwen2 has 12 attention heads, which do not divide over 8",
        ),
    ],
)
def test_a_rollout_tp_the_plan_cannot_take_is_one_line(capsys, extra, says):
    argv = ["train", "--plan", "--fsdp", "--plan-world-size", "8", "--plan-prompt-tokens", "64", "--device", "cuda"]
    if "--model" not in extra:
        argv += ["--model", str(CONFIGS / "qwen2.5-72b")]
    assert fastppo_main([*argv, *extra]) == 2
    assert says in capsys.readouterr().err


def test_the_advice_names_rollout_tp_and_the_ranks_that_fit(capsys):
    argv = ["train", "--plan", "--model", str(CONFIGS / "qwen2.5-72b"), "--plan-prompt-tokens", "512"]
    argv += ["--device", "cuda", "--plan-device-memory", "80", "--plan-world-size", "8", "--lora-rank", "64"]
    for key, value in AT_SCALE.items():
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    assert fastppo_main(argv) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("  it would fit with: --rollout-tp 8 (") and "16 ranks (--plan-world-size 16)" in last
