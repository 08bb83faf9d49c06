"""End to end against the trainer users would pick instead: ``fastppo train`` beside TRL's
``GRPOTrainer`` on the same model, prompts, reward, batch shape and learning rate, in one run.

Both run GRPO without a KL term (TRL's default ``beta=0``): ``prompts x samples`` completions of up
to ``max_new_tokens`` per iteration, one AdamW step on them (TRL: ``num_iterations=1``,
``steps_per_generation=1``), a constant learning rate, weight decay 0.01 (torch's AdamW default,
which fastppo uses), dropout off, temperature 1, token-mean loss over the batch (TRL's default
``loss_type="dapo"``), rewards scaled by the group's std. TRL samples with Hugging Face
``generate()``; fastppo with its KV-cached sampler. Each iteration is timed from the first
rollout token to the end of the optimizer step (TRL: from ``on_step_begin`` to ``on_step_end``).

Three workloads: ``arithmetic``, the shipped task's short prompts; ``chat``, what a practitioner
runs (``chat_workload.py``: chat prompts of 150-300 tokens, long-tail answers, the gsm8k verifier),
where most of the tokens an update processes are copies of the prompts unless it shares them;
``tools``, multi-turn episodes with a calculator (the built-in ``multiply`` task, the shipped ChatML
template with tools, at most 2 calling turns, TRL's Hermes parser for its calls): TRL generates the
batch, runs the tools, and prefills prompt + turns + results again for every row that called one;
fastppo prefills only the results onto each row's cache. Each trainer's prefill tokens per episode
are counted (TRL's: the real tokens of every ``generate`` input; fastppo's: the sampler's).
TRL's ``max_completion_length`` is ``max_new_tokens`` + ``TOOL_TOKENS`` (its budget holds the
results too); fastppo's ``max_new_tokens`` bounds the sampled tokens and ``max_tool_tokens`` the
rest.

Each trainer runs as its users would run it: fastppo in this process, each TRL run after it in a
fresh one (fastppo's run sets glibc's heap policy for its process). Reported per trainer: seconds
per iteration (median over the iterations after the first two, which pay for warm-up), the system
CPU seconds in them (the kernel's time, on a CPU run mostly page faults on memory the process maps
afresh: under glibc's default policy, tensors above its mmap threshold are mapped anew each time
and its heap's free top is trimmed, so faults fall over the first iterations and rise again in one
that sets a new peak; on a KVM guest a fault costs about 10 us; fastppo keeps freed memory for
the next iteration), generated tokens per second, and the reward reached at equal wall-clock: the
mean reward of the last 5 iterations each trainer had finished when the slower one's run would
have been cut to the faster one's total time.
"""

import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import torch

try:
    import resource
except ImportError:  # not a POSIX system: no system time to report
    resource = None

TOOL_TOKENS = 64  # the tools workload's room for results and scaffolding per episode


def system_seconds() -> float:
    """This process's system CPU seconds so far (all its threads; 0 where there is no ``resource``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime if resource is not None else 0.0


def _workload_fields(workload: str, samples: int, max_new_tokens: int) -> dict:
    """The ``fastppo train`` fields of ``workload`` beyond the shared shape."""
    from ..agents.template import SHIPPED_TEMPLATE
    from . import chat_workload

    if workload == "chat":
        return chat_workload.train_fields(tempfile.mkdtemp(prefix="fastppo-versus-trl-chat-"), samples, max_new_tokens)
    if workload == "tools":
        return {
            "task": "multiply",
            "tools": ["calculator"],
            "chat_template": str(SHIPPED_TEMPLATE),
            "max_tool_calls": 2,
            "max_tool_tokens": TOOL_TOKENS,
            "evaluate": False,
        }
    return {}


def _fastppo_run(model, device, prompts, samples, max_new_tokens, lr, iterations, seed, bf16, workload, limits) -> list:
    from ..trainer import PPOTrainer, TrainConfig

    chat = _workload_fields(workload, samples, max_new_tokens)
    config = TrainConfig.from_flat(
        {
            "model": model,
            "out": tempfile.mkdtemp(prefix="fastppo-versus-trl-"),
            "save": False,
            "device": device.type,
            "iterations": iterations,
            "prompts_per_iteration": prompts,
            "samples_per_prompt": samples,
            "max_new_tokens": max_new_tokens,
            "lr": lr,
            "seed": seed,
            "estimator": "grpo",
            "kl_coef": 0.0,
            **({"autocast": True, "rollout_dtype": "bfloat16"} if bf16 else {}),
            **chat,
        }
    ).validate()
    trainer = PPOTrainer(config)
    sampled = _recording(trainer.rollouts)
    sampler = trainer.rollouts.sampler
    rollout_dtype = next(sampler.model.parameters()).dtype
    rows = []
    for i in range(iterations):
        sampled.clear()
        start, system = time.perf_counter(), system_seconds()
        metrics = trainer.iteration(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows.append(
            {
                "seconds": time.perf_counter() - start,
                "system": system_seconds() - system,
                "reward": metrics["reward_mean"],
                "tokens": metrics.get("sampled_length", metrics["response_length"]) * prompts * samples,
                "prefill_per_episode": sampler.prefill_tokens / (prompts * samples),
                "calling": metrics.get("tools/calling"),
                "phases": {
                    "rollout": metrics["time_rollout"],
                    "update": metrics["time_forward"] + metrics["time_update"],
                },
                "limits": _phase_limits(
                    limits, sampler, rollout_dtype, torch.bfloat16 if bf16 else torch.float32, sampled, samples
                ),
            }
        )
    return rows


def _recording(rollouts) -> list:
    """The training rollouts ``rollouts.sample`` returns, with the sampler's prefill count of each,
    appended to a list the caller clears (the held-out evaluation's are not recorded)."""
    sample, sampled = rollouts.sample, []

    def recorded(*args, **kwargs):
        rollout = sample(*args, **kwargs)
        sampled.append((rollout, rollouts.sampler.prefill_tokens))
        return rollout

    rollouts.sample = recorded
    return sampled


def _phase_limits(limits, sampler, rollout_dtype, update_dtype, sampled: list, samples: int) -> dict:
    """Each phase's least time on this machine (``limits.py``) for this iteration's rollouts."""
    from .phase_limits import rollout_seconds, update_seconds

    rollout = update = 0.0
    for r, prefill in sampled:
        prompt_lens, lens = [len(p) for p in r.prompt_ids], r.response_lens.tolist()
        rollout += rollout_seconds(
            limits, sampler.model, rollout_dtype, prompt_lens, lens, sampler.max_batch_size, prefill
        )
        tokens = sum(prompt_lens[::samples]) + sum(lens)  # each prompt once for its samples
        update += update_seconds(limits, sampler.model, update_dtype, tokens)
    return {"rollout": rollout, "update": update}


def _trl_run(
    model, device, prompts, samples, max_new_tokens, lr, iterations, seed, bf16, workload, checkpointing
) -> list:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ..rewards.verifiers import gsm8k_reward
    from ..trainer.modeling.loading import load_policy
    from ..trainer.prompts import tasks
    from . import chat_workload

    policy, tokenizer = load_policy(model)
    tools = {}
    if workload == "tools":
        from trl.chat_template_utils import qwen3_template  # TRL's parser of <tool_call>{json}</tool_call>

        from ..agents.builtin import calculator
        from ..agents.template import SHIPPED_TEMPLATE

        tokenizer.chat_template = SHIPPED_TEMPLATE.read_text()
        tokenizer.response_template = qwen3_template
        rows = tasks.TASKS["multiply"].prompts(seed=seed)
        tools = {"tools": [calculator]}

        def score(prompts, completions, answer, **_):  # an episode: the last assistant message's number
            return gsm8k_reward(prompts, completions, answer)
    elif workload == "chat":
        rows = chat_workload.rows(256)

        def score(prompts, completions, answer, **_):  # TRL hands conversational completions as messages
            return gsm8k_reward(prompts, [c[-1]["content"] if isinstance(c, list) else c for c in completions], answer)
    else:
        task = tasks.TASKS["arithmetic"]
        rows, reward = task.prompts(seed=seed), task.reward

        def score(prompts, completions, **_):
            return reward(prompts, completions)

    score.__name__ = "reward"
    starts, ends, prefilled = [], [], [0]
    generate = policy.generate

    def counted(*args, **kwargs):  # every prompt (and, with tools, conversation so far) it prefills
        prefilled[0] += int(kwargs["attention_mask"].sum())
        return generate(*args, **kwargs)

    policy.generate = counted

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            starts.append((time.perf_counter(), prefilled[0], system_seconds()))

        def on_step_end(self, *_, **__):
            if device.type == "cuda":
                torch.cuda.synchronize()
            ends.append((time.perf_counter(), prefilled[0], system_seconds()))

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-versus-fastppo-"),
        per_device_train_batch_size=prompts * samples,
        num_generations=samples,
        max_completion_length=max_new_tokens + (TOOL_TOKENS if workload == "tools" else 0),
        max_steps=iterations,
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        optim="adamw_torch",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=device.type != "cuda",
        bf16=bf16,
        disable_dropout=True,
        seed=seed,
        temperature=1.0,
        num_iterations=1,
        beta=0.0,
        **({"max_tool_calling_iterations": 2} if workload == "tools" else {}),
        **({} if checkpointing else {"gradient_checkpointing": False}),
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=score,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
        callbacks=[Clock()],
        **tools,
    )
    trainer.train()
    logs = [row for row in trainer.state.log_history if "reward" in row]
    return [
        {
            "seconds": end - start,
            "system": end_system - start_system,
            "reward": log["reward"],
            "tokens": log["completions/mean_length"] * prompts * samples,
            "prefill_per_episode": (end_prefill - start_prefill) / (prompts * samples),
            "calling": None,
        }
        for (start, start_prefill, start_system), (end, end_prefill, end_system), log in zip(starts, ends, logs)
    ]


def _on_its_own(run, *args, **kwargs):
    """``run(*args, **kwargs)`` in a fresh interpreter, so that a TRL run starts as a TRL user's would:
    fastppo's run before it sets glibc's heap policy for its whole process (it keeps freed memory
    for the next iteration, ``trainer/modeling/host_memory.py``) and leaves that memory behind."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run, *args, **kwargs).result()


WORKLOADS = {
    "arithmetic": "arithmetic task",
    "chat": "chat workload (prompts of 150-300 tokens, gsm8k verifier)",
    "tools": "tools workload (multiply task, calculator tool, up to 2 calling turns per episode, gsm8k verifier)",
}


def _summary(name: str, rows: list, cutoff: float) -> dict:
    kept = rows[2:] or rows  # the iterations after warm-up
    steady = [r["seconds"] for r in kept]
    elapsed, finished = 0.0, []
    for r in rows:
        elapsed += r["seconds"]
        if elapsed > cutoff + 1e-9:
            break
        finished.append(r)
    last = finished[-5:] or rows[:1]
    return {
        "trainer": name,
        "iterations": len(rows),
        "seconds_median": statistics.median(steady),
        "seconds_min": min(steady),
        "seconds_max": max(steady),
        "system_median": statistics.median(r["system"] for r in kept),
        "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows),
        "total_seconds": sum(r["seconds"] for r in rows),
        "reward_first5": statistics.mean(r["reward"] for r in rows[:5]),
        "iterations_by_cutoff": len(finished),
        "reward_at_cutoff": statistics.mean(r["reward"] for r in last),
        "prefill_per_episode": statistics.mean(r["prefill_per_episode"] for r in rows),
    }


def compare(
    model=None,
    device=None,
    *,
    prompts: int = 16,
    samples: int = 8,
    max_new_tokens: int = 8,
    lr: float = 5e-4,
    iterations: int = 30,
    seed: int = 0,
    bf16: bool = None,
    workload: str = "arithmetic",
    trl_without_checkpointing: bool = False,
) -> dict:
    """Both trainers for ``iterations`` on ``workload``; a summary row each (see the module).
    ``bf16`` (default: on CUDA): both in mixed precision, fastppo with bf16 autocast and a bf16
    rollout copy, TRL with ``bf16=True``; else both in fp32. ``trl_without_checkpointing`` runs TRL
    a second time with its gradient checkpointing off (its default turns it on); the speed-up is
    against the faster of TRL's runs."""
    device = torch.device("cpu") if device is None else device
    bf16 = device.type == "cuda" if bf16 is None else bf16
    shape = dict(
        prompts=prompts,
        samples=samples,
        max_new_tokens=max_new_tokens,
        lr=lr,
        iterations=iterations,
        seed=seed,
        bf16=bf16,
        workload=workload,
    )
    from .phase_limits import measure

    limits = measure(device)
    runs = {
        "fastppo train": _fastppo_run(model, device, **shape, limits=limits),
        "TRL GRPOTrainer": _on_its_own(_trl_run, model, device, **shape, checkpointing=True),
    }
    if trl_without_checkpointing:
        runs["TRL GRPOTrainer, no gradient checkpointing"] = _on_its_own(
            _trl_run, model, device, **shape, checkpointing=False
        )
    cutoff = min(sum(r["seconds"] for r in rows) for rows in runs.values())
    summaries = [_summary(name, rows, cutoff) for name, rows in runs.items()]
    ours, theirs = summaries[0], min(summaries[1:], key=lambda r: r["seconds_median"])
    return {
        "model": model or "the shipped tiny model",
        "shape": shape,
        "cutoff_seconds": cutoff,
        "speedup": theirs["seconds_median"] / ours["seconds_median"],
        "against": theirs["trainer"],
        "rows": summaries,
        "limits": asdict(limits),
        "phases": _phases(runs["fastppo train"]),
    }


def _phases(rows: list) -> list:
    """fastppo's phases over the steady iterations: median seconds, median limit, and the share."""
    steady = rows[2:] or rows
    out = []
    for phase in ("rollout", "update"):
        seconds = statistics.median(r["phases"][phase] for r in steady)
        limit = statistics.median(r["limits"][phase] for r in steady)
        out.append({"phase": phase, "seconds": seconds, "limit": limit, "share": limit / seconds})
    seconds = statistics.median(r["seconds"] for r in steady)
    limit = statistics.median(r["limits"]["rollout"] + r["limits"]["update"] for r in steady)
    out.append({"phase": "iteration", "seconds": seconds, "limit": limit, "share": limit / seconds})
    return out


def markdown(result: dict, machine: str) -> str:
    s = result["shape"]
    lines = [
        f"## fastppo train vs TRL GRPOTrainer: {result['model']}",
        "",
        f"{machine}; {WORKLOADS[s.get('workload', 'arithmetic')]}, {s['prompts']} prompts x "
        f"{s['samples']} samples, up to "
        f"{s['max_new_tokens']} new tokens, lr {s['lr']}, {s['iterations']} iterations each, "
        f"{'bf16 mixed precision' if s['bf16'] else 'fp32'}, one run. "
        f"Equal wall-clock: {result['cutoff_seconds']:.1f} s. fastppo speed-up: "
        f"**{result['speedup']:.2f}x** against {result['against']} (median seconds per iteration).",
        "",
        "| trainer | s/iteration median (min-max) | system CPU s/iteration | generated tokens/s | "
        "reward, first 5 | iterations by the cutoff | reward at the cutoff (last 5) | prefill tokens per episode |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['trainer']} | {r['seconds_median']:.3f} ({r['seconds_min']:.3f}-{r['seconds_max']:.3f}) | "
            f"{r['system_median']:.2f} | {r['tokens_per_s']:.0f} | {r['reward_first5']:.3f} | "
            f"{r['iterations_by_cutoff']} | {r['reward_at_cutoff']:.3f} | {r['prefill_per_episode']:.0f} |"
        )
    lines += [
        "",
        "System CPU seconds: the kernel's time in an iteration (median over the same iterations, all threads), on "
        "a CPU run mostly page faults on memory mapped afresh, which fall over the first iterations and rise in one "
        "that sets a new peak.",
    ]
    from .phase_limits import gflops

    limits = result["limits"]
    rates = ", ".join(f"{dtype} matmul {gflops(flops)}" for dtype, flops in limits["matmul_flops"].items())
    lines += [
        "",
        f"fastppo's phases against this machine's limit ({rates}, read {limits['read_bytes_per_s'] / 1e9:.1f} GB/s; "
        "`fastppo/bench/phase_limits.py`): median seconds per iteration, the least the phase's work could take "
        "here, and the share of that limit reached.",
        "",
        "| phase | seconds | limit (s) | share of the limit |",
        "| --- | --- | --- | --- |",
        *(f"| {p['phase']} | {p['seconds']:.3f} | {p['limit']:.3f} | {p['share']:.0%} |" for p in result["phases"]),
    ]
    return "\n".join(lines) + "\n"
