"""``fastppo train --plan``: the memory one device will need for a run, from the model's config
alone, before anything is loaded.

The model is instantiated on the meta device (shapes, no storage, no weights read), so its
parameter count, tied embeddings and LoRA targets are the real ones. What the run holds is
counted from the options, each line with its dtype:

- exact: parameters (fp32 masters; with LoRA the frozen base in the rollout dtype and the fp32
  adapters), gradients, AdamW's two moments and step counters, the bf16 rollout copy, the
  reference, the critic, the KV cache (the sampler's paged budget: ``--rollout-kv-memory``, on
  CUDA by default what the other lines leave, less a tenth of the device, and never more than
  every slot at the cap takes; the line says how many rows in flight it allows, against the
  static layout's slot per row at the cap, for responses of an assumed mean length);
- measured: on the CPU, the process itself (Python, torch, transformers: its resident memory
  before any model loads), which with freed tensor memory returned at once (``host_memory.py``)
  is what a run holds besides the lines above;
- estimated: activations kept for the backward per layer and token of one forward (each prompt
  once for its samples with the shared prefix; ``forward_tokens``), ``(8 hidden + 4
  intermediate + 2 kv_dim)`` values of a Llama-like block, measured from the tensors autograd
  saves, plus with shared prompts each response's copy of its prompt's keys and values, which
  the update's split attention keeps (``prompt_copies``); with checkpointing, each block's input
  plus one block recomputed at a time; one block's worth more for the backward's working
  gradients, and the fused loss head's fp32 logits chunk and weight gradient.

Without ``--fsdp`` every rank holds whole copies, so a rank's plan is one device's whatever the
world size; with more than one rank the gradient all-reduce adds a flat copy of the gradients.
With ``--fsdp`` (``sharding.py``) the weights, gradients, AdamW moments, reference and critic are
1/N per rank (FSDP's padding aside), and the plan adds what is gathered: the blocks in the compute
dtype (one at a time, or all of them through the backward without reshard-after-forward), the
policy's root with its LM head in the masters' dtype, and the whole rollout copy, which is held
during the rollout only.
"""

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ...limits import GiB
from ..modeling.precision import Precision, stored_dtype
from ..update.row_layout import mask_refusal

if TYPE_CHECKING:  # for the annotations only
    from ..configuration.config import TrainConfig


#: When a line's memory is on the device: the whole run, the rollout only (under ``--fsdp`` the
#: sampler's copy, gathered whole or split, and its KV cache, which sleeps through the update), the
#: update only (what the forwards and backwards keep), while loading only, or never
#: (``--fsdp-offload``'s host memory).
HELD, ROLLOUT, UPDATE, STARTUP, HOST = "held", "rollout", "update", "start-up", "host"


@dataclass
class Line:
    name: str
    bytes: int
    how: str  # the count behind the number
    when: str = HELD


def phases(lines: list) -> dict:
    """``{phase: bytes}`` on the device: the start-up's peak, the rollout's and the update's (each
    the held lines plus its own), and the host's offloaded state."""
    held = sum(line.bytes for line in lines if line.when == HELD)
    own = {when: sum(line.bytes for line in lines if line.when == when) for when in (ROLLOUT, UPDATE, STARTUP, HOST)}
    return {STARTUP: own[STARTUP], ROLLOUT: held + own[ROLLOUT], UPDATE: held + own[UPDATE], HOST: own[HOST]}


def peak(lines: list) -> int:
    """The most the device holds at once: the largest of the start-up's, the rollout's and the update's."""
    by_phase = phases(lines)
    return max(by_phase[STARTUP], by_phase[ROLLOUT], by_phase[UPDATE])


@dataclass
class ModelShape:
    """What the plan needs of a model, read from its meta instantiation."""

    params: int  # distinct parameters (tied ones once)
    tensors: int  # distinct parameter tensors
    backbone_params: int  # without the LM head (what a critic copies)
    backbone_tensors: int
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    kv_dim: int  # key/value heads x head dim
    head_dim: int
    lora_params: int  # adapter parameters for the given LoRA options (0 without)
    lora_tensors: int
    packed_params: int = 0  # what the sampler's packed copy holds (rollout/packed.py): its projections


def model_shape(model_config, lora_rank=None, lora_target_modules=None) -> ModelShape:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    params = list(model.parameters())
    backbone = list(model.base_model.parameters())
    c = model_config
    hidden = c.hidden_size
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    if getattr(c, "qk_rope_head_dim", None) is not None:  # MLA: a decompressed key per query head, each
        # value stored padded to its key's size (rollout/interface.py)
        kv_heads, head_dim = heads, c.qk_nope_head_dim + c.qk_rope_head_dim
    intermediate = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * hidden
    lora_params = lora_tensors = 0
    if lora_rank is not None:
        from ..modeling.lora import adaptable_layers, lora_targets

        for _, module in adaptable_layers(model, lora_targets(model, lora_target_modules)):
            lora_params += lora_rank * sum(module.weight.shape)  # A (r, in) and B (out, r)
            lora_tensors += 2
    from ...rollout.lean import FAMILIES

    family = FAMILIES.get(c.model_type)
    groups = family.projections(model) if family is not None and family.shapes(model) is not None else {}
    matrices = {id(p): p for layers in groups.values() for g in layers for m in g for p in m.parameters()}
    return ModelShape(
        packed_params=sum(p.numel() for p in matrices.values()),
        params=sum(p.numel() for p in params),
        tensors=len(params),
        backbone_params=sum(p.numel() for p in backbone),
        backbone_tensors=len(backbone),
        vocab=model.get_output_embeddings().weight.shape[0],
        hidden=hidden,
        intermediate=intermediate,
        layers=c.num_hidden_layers,
        kv_dim=kv_heads * head_dim,
        head_dim=head_dim,
        lora_params=lora_params,
        lora_tensors=lora_tensors,
    )


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def memory_plan(
    config: "TrainConfig",
    model_config,
    *,
    prompt_tokens: int,
    device_type: str,
    world_size: int = 1,
    reward_model_config=None,
    runtime: int = 0,
    kv_memory: Optional[int] = None,
    mean_response_tokens: Optional[int] = None,
) -> list:
    """The lines of one device's memory for a run of ``config`` (a validated ``TrainConfig``) on the
    model ``model_config``, prompts of up to ``prompt_tokens`` tokens; ``runtime``: bytes the
    process holds besides tensors (on the CPU, :func:`runtime_bytes`); ``kv_memory``: the KV
    budget in bytes (default: :func:`kv_line`'s); ``mean_response_tokens``: the responses' assumed
    mean length, for the rows in flight (default: a quarter of the budget)."""
    from ...ops.token_logprobs_from_hidden import default_chunk_size

    r, a, lora = config.rollout, config.algo, config.lora
    precision = Precision.of(
        config.optim.autocast, r.rollout_dtype, config.run.save_dtype, device_type, stored_dtype(model_config)
    )
    m = model_shape(model_config, lora.lora_rank, lora.lora_target_modules)
    compute = _size(precision.compute or torch.float32)
    rollout, frozen = _size(precision.rollout), _size(precision.frozen)
    rollout_name = str(precision.rollout)[6:]
    fsdp, tp = config.sharding.fsdp, config.sharding.rollout_tp
    shards = world_size if fsdp else 1
    per_rank = f" / {shards} ranks" if fsdp else ""
    offloaded = HOST if fsdp and config.sharding.fsdp_offload else HELD  # the trained models' state
    lines = []
    loaded = 0  # what loading leaves on the device: each model's weights (a critic's without its state)
    if lora.lora_rank is None:
        trainable, tensors = m.params, m.tensors
        lines.append(
            Line("policy weights", 4 * m.params // shards, f"{m.params:,} fp32 master weights{per_rank}", offloaded)
        )
    else:
        trainable, tensors = m.lora_params, m.lora_tensors
        lines.append(
            Line(
                "policy weights",
                (rollout * m.params + 4 * m.lora_params) // shards,
                f"{m.params:,} frozen in {rollout_name} + {m.lora_params:,} fp32 adapter{per_rank}",
                offloaded,
            )
        )
    if offloaded == HELD:
        loaded += lines[-1].bytes
    gradients = HOST if offloaded == HOST else UPDATE  # freed at each optimizer step
    lines += [
        Line("gradients", 4 * trainable // shards, f"{trainable:,} fp32{per_rank}, from backward to step", gradients),
        Line(
            "AdamW state",
            8 * trainable // shards + 4 * tensors,
            f"2 fp32 moments{per_rank} + a step per tensor ({tensors})",
            offloaded,
        ),
    ]
    if tp > 1:
        lines.append(
            Line(
                "rollout copy",
                rollout * m.params // tp,
                f"{m.params:,} in {rollout_name} / {tp} ranks (--rollout-tp; LoRA merged in), for the rollout only",
                ROLLOUT,
            )
        )
    elif fsdp or (lora.lora_rank is None and precision.rollout != torch.float32):
        when = ROLLOUT if fsdp else HELD
        lines.append(
            Line(
                "rollout copy",
                rollout * m.params,
                f"{m.params:,} in {rollout_name}" + (", whole, gathered for the rollout only" if fsdp else ""),
                when,
            )
        )
        if when == HELD:
            loaded += lines[-1].bytes
    if r.rollout_weights == "packed" and m.packed_params and lora.lora_rank is None and not fsdp:
        lines.append(
            Line(
                "packed rollout copy",
                rollout * m.packed_params,
                f"{m.packed_params:,} of the projections in {rollout_name}, fused and in the layout "
                "measured fastest at start (MKL's packed fp32 format holds ~1.3x this, the linear layout shares the "
                "unfused matrices; --rollout-weights live: none)",
            )
        )
    if a.kl_coef > 0 and lora.lora_rank is None:
        lines.append(
            Line("reference", frozen * m.params // shards, f"{m.params:,} in {str(precision.frozen)[6:]}{per_rank}")
        )
        loaded += lines[-1].bytes
    if config.uses_critic:
        critic = m.backbone_params + m.hidden + 1
        if offloaded == HELD:
            loaded += 4 * critic // shards
        lines.append(
            Line(
                "critic + its gradients and AdamW state",
                16 * critic // shards + 4 * (m.backbone_tensors + 2),
                f"{critic:,} fp32, trained in full{per_rank}",
                offloaded,
            )
        )
    if fsdp:
        block = (m.backbone_params - m.vocab * m.hidden) // m.layers  # the embedding table is not a block's
        gathered = 1 if config.sharding.fsdp_reshard_after_forward else m.layers
        root = m.params - m.layers * block
        own = rollout if lora.lora_rank is not None else 4  # LoRA's frozen base is in the rollout dtype
        lines.append(
            Line(
                "gathered weights",
                compute * gathered * block + own * root,
                f"{gathered} block(s) of {block:,} in the compute dtype + the root's {root:,} "
                f"(embeddings, norm, LM head) in its own",
                UPDATE,
            )
        )
    if reward_model_config is not None:
        rm = model_shape(reward_model_config)
        lines.append(Line("reward model", frozen * rm.params, f"{rm.params:,} in {str(precision.frozen)[6:]}"))
    rows, slots = r.prompts_per_iteration * r.samples_per_prompt, config.sampler_slots * tp
    kv = kv_line(config, m, prompt_tokens, rollout, kv_memory, mean_response_tokens, device_type, tp)
    if not fsdp or r.max_staleness:  # kept through the update: for the CUDA graphs of a run on one device,
        kv.when = HELD  # or a stream's rows in flight
    lines.append(kv)
    if r.max_staleness:
        lines += in_flight_lines(config, m, prompt_tokens, rollout)
    lines.append(
        Line(
            "sampler step logits",
            slots * m.vocab * (rollout + 4),
            f"{slots} x {m.vocab:,}, and fp32" + (f" (a group's rows, gathered from {tp} ranks)" if tp > 1 else ""),
            ROLLOUT,
        )
    )
    mb_rows = rows // a.minibatches
    tokens, laid_out = forward_tokens(config, model_config, mb_rows, prompt_tokens)
    responses = mb_rows * config.response_tokens
    copies = prompt_copies(config, model_config, mb_rows, prompt_tokens)
    block = ((8 * m.hidden + 4 * m.intermediate + 2 * m.kv_dim) * tokens + 2 * m.kv_dim * copies) * compute
    models = 2 if config.uses_critic else 1
    outside = 2 * m.hidden * compute * tokens  # the embeddings' output and the final norm's
    if config.model.gradient_checkpointing:
        kept = m.layers * m.hidden * 4 * tokens + block + outside
        how = f"{m.layers} block inputs + 1 block recomputed, {tokens:,} tokens per forward ({laid_out})"
    else:
        kept = m.layers * block + outside
        how = f"{m.layers} blocks x {tokens:,} tokens per forward ({laid_out})"
    if copies:
        how += f", each response's copy of its prompt's keys and values ({copies:,} positions a block)"
    lines.append(Line("activations" + (" (policy and critic)" if models == 2 else ""), models * kept, how, UPDATE))
    chunk = default_chunk_size(responses, m.vocab, device_type)
    half_grad = 2 * chunk * m.vocab if device_type == "cuda" else 0  # the chunk's logit gradient, bf16
    lines.append(
        Line(
            "loss head",
            4 * (chunk * m.vocab + m.vocab * m.hidden + responses * m.hidden) + half_grad,
            f"fp32 logits chunk {chunk} x {m.vocab:,}{' and its bf16 gradient' if half_grad else ''}, "
            "head gradient, hidden gradient",
            UPDATE,
        )
    )
    if world_size > 1 and not fsdp:
        lines.append(Line("gradient all-reduce bucket", 4 * trainable, "a flat copy of the gradients", UPDATE))
    if runtime:
        lines.append(Line("runtime", runtime, "this process before any model: Python, torch, transformers"))
    if fsdp and world_size > 1:  # parallel/sharded_loading.py
        how = "each rank reads its own shards of the checkpoint (one whose names are not the model's loads whole)"
    else:
        how = "every model whole on every rank"
    lines.append(Line("start-up", loaded + runtime, how, STARTUP))
    return lines


def kv_line(
    config: "TrainConfig",
    m: ModelShape,
    prompt_tokens: int,
    size: int,
    memory,
    mean_response: Optional[int],
    device_type,
    split: int = 1,
) -> Line:
    """The sampler's KV cache (a sharded run's sleeps through the update): its budget
    (``memory`` bytes, else ``--rollout-kv-memory``, else every slot at the cap), and the rows in
    flight it would allow, static and paged (beyond the slots the sampler takes, to show the
    headroom), for responses of ``mean_response`` tokens on average; ``split``: the ranks of a
    rollout group (``--rollout-tp``), whose sampler takes their rows and holds 1/``split`` of each
    position's heads. Paged: one row at the cap held back (admission keeps a
    row able to finish), each group's full prompt blocks once, each sample its partial prompt
    block, its mean response and a stretch of steps (16 decode steps between looks)."""
    from ...rollout.flash import FLASH_BLOCK
    from ...rollout.paged import DEFAULT_BLOCK, KVMemoryError, block_within, paged_blocks

    r = config.rollout
    flash = device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None  # as the sampler would
    slots, n, cap = config.sampler_slots * split, r.samples_per_prompt, prompt_tokens + config.response_tokens
    block = block_within(
        r.rollout_kv_block_size or (FLASH_BLOCK if flash else DEFAULT_BLOCK), cap, FLASH_BLOCK if flash else 1
    )
    kv_dim = max(m.kv_dim // split, m.head_dim)  # fewer KV heads than ranks: one a rank
    position = 2 * m.layers * kv_dim * size  # bytes of one position: K and V in every layer
    if kv_dim * split > m.kv_dim:
        shared = f", each KV head on {kv_dim * split // m.kv_dim} of the {split} ranks"
    else:
        shared = ""
    if memory is None and r.rollout_kv_memory is not None:
        memory = given_kv_bytes(r.rollout_kv_memory)
    static_bytes = slots * cap * position
    if (memory is None or memory >= static_bytes) and not r.rollout_kv_block_size:  # the sampler's "auto"
        return Line(
            "KV cache",
            static_bytes,
            f"{position:,} B a position ({m.layers} layers x K,V x {kv_dim}{shared}); static, every one of {slots} "
            f"slots at the cap ({cap:,}): the budget pages nothing",
            ROLLOUT,
        )
    try:
        blocks = paged_blocks(memory, slots, cap, block, position // 2)
    except KVMemoryError as error:
        return Line("KV cache", memory, f"too small: {error}", ROLLOUT)
    mean = min(mean_response or config.response_tokens // 4 or 1, config.response_tokens)
    static = blocks * block // cap
    per_group = prompt_tokens // block + n * math.ceil((prompt_tokens % block + mean + 16) / block)
    paged = max(blocks - 1 - math.ceil(cap / block), 0) // per_group * n
    return Line(
        "KV cache",
        blocks * block * position,
        f"{position:,} B a position ({m.layers} layers x K,V x {kv_dim}{shared}); {blocks:,} blocks of {block}; a row "
        f"{math.ceil(cap / block)} blocks at the cap ({cap:,}), {math.ceil((prompt_tokens + mean) / block)} at "
        f"{prompt_tokens + mean:,} (mean response {mean:,}, assumed); rows in flight it allows: {static:,} "
        f"static, ~{paged:,} paged (the sampler takes {slots})",
        ROLLOUT,
    )


def in_flight_lines(config: "TrainConfig", m: ModelShape, prompt_tokens: int, size: int) -> list:
    """What rollouts that never drain (``max_staleness`` K) hold beyond the KV cache: the outputs of
    the K + 1 batches in flight (each token's id, log-prob, version and mask; the rows in flight hold
    the cache's slots, counted above), and with a held-out evaluation its own sampler's cache (the
    stream's rows keep theirs), static at the cap."""
    r = config.rollout
    rows, batches = r.prompts_per_iteration * r.samples_per_prompt, r.max_staleness + 1
    token = 8 + 4 + 8 + 1
    lines = [
        Line(
            "rollouts in flight",
            batches * rows * (config.response_tokens + 1) * token,
            f"{batches} batches of {rows} rows x {config.response_tokens + 1} tokens: id, log-prob, version, mask "
            f"(--max-staleness {r.max_staleness}; their rows hold the KV cache's slots)",
        )
    ]
    if config.eval.evaluate:
        slots, cap = config.sampler_slots, prompt_tokens + config.response_tokens
        position = 2 * m.layers * m.kv_dim * size
        lines.append(
            Line(
                "held-out KV cache",
                slots * cap * position,
                f"the held-out sampler's own, {slots} slots at the cap ({cap:,}): the stream's rows keep theirs",
                ROLLOUT,
            )
        )
    return lines


def given_kv_bytes(gib: float) -> int:
    """``--rollout-kv-memory`` in bytes: a part of a byte is a byte (never 0, which is no budget:
    a budget too small is the sampler's one-line refusal)."""
    return max(1, math.ceil(gib * GiB))


def kv_memory(
    config: "TrainConfig", model_config, *, prompt_tokens: int, device_type: str, available: int, **plan
) -> Optional[int]:
    """The sampler's KV budget in bytes: ``--rollout-kv-memory``; else on CUDA what the plan's
    other lines leave of ``available``, less a tenth of it (what the plan does not count: the
    allocator's fragmentation, the CUDA context); else (or when nothing is left) None: every slot
    at the cap."""
    if config.rollout.rollout_kv_memory is not None:
        return given_kv_bytes(config.rollout.rollout_kv_memory)
    if device_type != "cuda":
        return None
    lines = memory_plan(config, model_config, prompt_tokens=prompt_tokens, device_type=device_type, **plan)
    (kv,) = [line for line in lines if line.name == "KV cache"]
    beside = phases([line for line in lines if line is not kv])  # what the cache's phases hold besides it
    others = beside[ROLLOUT] if kv.when == ROLLOUT else max(beside[ROLLOUT], beside[UPDATE])
    left = available - available // 10 - others
    return left if left > 0 else None  # nothing left: the plan does not fit, whatever the cache


def _shares(config: "TrainConfig", model_config, prompt_tokens: int) -> bool:
    """Whether the update encodes each prompt once for its samples (``row_layout.py``): the shared
    prefix on, samples to share it, and no window of the model refusing its masks."""
    row = prompt_tokens + config.response_tokens
    shared = config.model.shared_prefix and mask_refusal(model_config, row) is None
    return shared and config.rollout.samples_per_prompt > 1


def forward_tokens(config: "TrainConfig", model_config, rows: int, prompt_tokens: int) -> tuple:
    """``(tokens, how)``: the most tokens one forward of the update lays out for a minibatch of
    ``rows``, every response at its most tokens (``row_layout.py``): each prompt once for its samples
    (one more prompt where a minibatch cuts through a group), or a padded row per sample (also
    where the model's windows refuse the shared masks, ``mask_refusal``); no more than the
    micro-batch budget (or one row, when a row is longer than it)."""
    budget, row = config.algo.max_tokens_per_microbatch, prompt_tokens + config.response_tokens
    tokens, how = _laid_out(config, model_config, rows, prompt_tokens)
    if budget is not None and budget < tokens:
        tokens, how = max(budget, row), f"micro-batches of <= {budget:,} tokens"
    return tokens, how


def _laid_out(config: "TrainConfig", model_config, rows: int, prompt_tokens: int) -> tuple:
    """:func:`forward_tokens` without the micro-batch budget."""
    r = config.rollout
    if _shares(config, model_config, prompt_tokens):
        prompts = -(-rows // r.samples_per_prompt) + (rows % r.samples_per_prompt != 0)
        return prompts * prompt_tokens + rows * config.response_tokens, f"{prompts} prompts once, {rows} responses"
    return rows * (prompt_tokens + config.response_tokens), f"{rows} padded rows"


def prompt_copies(config: "TrainConfig", model_config, rows: int, prompt_tokens: int) -> int:
    """Prompt positions whose keys and values the update's split attention keeps a second time in
    a layer, for one forward of a minibatch of ``rows``: each response's own copy of its prompt's
    (``update/unit_attention.py``), so as many as the forward lays out responses; none where each
    row is padded (the split needs shared prompts)."""
    if not _shares(config, model_config, prompt_tokens):
        return 0
    tokens, _ = forward_tokens(config, model_config, rows, prompt_tokens)
    whole, _ = _laid_out(config, model_config, rows, prompt_tokens)
    return rows * prompt_tokens * tokens // whole  # a budget's share of the responses (in proportion to its tokens)


def fitting_microbatch(
    config: "TrainConfig", model_config, *, prompt_tokens: int, device_type: str, available: int, **plan
) -> int:
    """The most tokens per forward (``--max-tokens-per-microbatch``) under which the plan of
    ``config`` fits ``available`` bytes; None when it fits without a budget, or would not fit even
    with one row per forward. ``plan``: :func:`memory_plan`'s other arguments."""
    lines = memory_plan(config, model_config, prompt_tokens=prompt_tokens, device_type=device_type, **plan)
    by_phase = phases(lines)
    if peak(lines) <= available or max(by_phase[STARTUP], by_phase[ROLLOUT]) > available:
        return None  # it fits, or what does not fit is not the update's
    rows = config.rollout.prompts_per_iteration * config.rollout.samples_per_prompt // config.algo.minibatches
    tokens, _ = forward_tokens(config, model_config, rows, prompt_tokens)
    activations = next(line.bytes for line in lines if line.name.startswith("activations"))
    budget = int((available - (by_phase[UPDATE] - activations)) * tokens / activations)
    return budget if budget >= prompt_tokens + config.response_tokens else None


def runtime_bytes() -> int:
    """This process's resident memory now (0 where ``/proc`` cannot say): on the CPU, what a run
    holds besides its tensors, since the trainer returns freed tensor memory (``host_memory.py``)."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def device_memory(device_type: str) -> int:
    """Total memory of the device the run would use (a CUDA device's, else the machine's RAM)."""
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def render(lines: list, available: int, header: str) -> str:
    """The plan's lines, each with when it holds its memory, then each phase's total and the peak
    against ``available``."""
    width = max(len(line.name) for line in lines)
    out = [header, ""]
    body = [line for line in lines if line.when != STARTUP]
    out += [f"  {line.name:<{width}}  {line.bytes / GiB:9.2f} GiB  {line.when:<7}  {line.how}" for line in body]
    by_phase, most = phases(lines), peak(lines)
    (startup,) = [line for line in lines if line.when == STARTUP]
    out += [
        "",
        f"  {'start-up':<{width}}  {by_phase[STARTUP] / GiB:9.2f} GiB  while the models load: {startup.how}",
        f"  {'rollout':<{width}}  {by_phase[ROLLOUT] / GiB:9.2f} GiB  the held lines and the rollout's",
        f"  {'update':<{width}}  {by_phase[UPDATE] / GiB:9.2f} GiB  the held lines and the update's",
    ]
    if by_phase[HOST]:
        out.append(f"  {'host':<{width}}  {by_phase[HOST] / GiB:9.2f} GiB  offloaded (--fsdp-offload), in CPU memory")
    verdict = "fits" if most <= available else "does NOT fit"
    out += [f"  {'peak':<{width}}  {most / GiB:9.2f} GiB  of {available / GiB:.1f} GiB: {verdict}"]
    return "\n".join(out) + "\n"
