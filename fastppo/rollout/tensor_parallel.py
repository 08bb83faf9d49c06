"""A model sharded over a group of ranks for decoding: tensor parallelism on PyTorch's DTensor.

The sampler decodes a model larger than one GPU by splitting each layer's matrices over the N ranks
of a group, as Megatron-LM lays them out: the query, key, value, gate and up projections by their
output columns (each rank computes its own heads and its share of the MLP, with no communication),
the attention output and down projections by their input rows (one all-reduce each per layer and
step), the embedding by vocabulary rows (a masked lookup, all-reduced) and the LM head by
vocabulary columns, its logits all-gathered so that every rank draws from the whole row: the draw
is then ``sample_tokens`` on the same logits as one rank's, the same tokens for the same seed
whatever top-k or top-p asks. Each rank's attention sees its own KV heads only, so the sampler's
cache, paged or static, holds 1/N of the keys and values, read by the same decode attention.

The layout of a family's layers is transformers' own declaration, its config's
``base_model_tp_plan`` (module patterns to "colwise", "rowwise" and the like), applied with
``torch.distributed.tensor.parallel.parallelize_module``; the embedding and LM head are added here.
A model's own modules then run on the shards (``interface.py``'s decoder), its attention reshaping
to the heads its projections return. With fewer KV heads than ranks (Qwen2.5-7B's 4 over 8), the
key and value projections stay whole on every rank (they are small: KV heads x head size rows)
and return only the one KV head the rank's query heads read, so each KV head is cached on
N / KV heads ranks. What is refused, in one line naming it: a family with no plan, a plan style
this does not apply (expert parallelism, packed projections), attention heads that do not divide
over N, and KV heads that neither divide over N nor divide N (a rank would hold part of a head).
"""

from typing import Optional

from torch import nn

#: transformers' plan styles this applies, each to the ``parallelize_module`` style it names
#: (None: the module stays whole on every rank, as norms inside an attention do).
STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise")
REPLICATED = ("replicated_with_grad_allreduce",)


class Unsharded(ValueError):
    """A model the tensor-parallel sampler cannot shard; the message names the family and why."""


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }[name]()


def _path(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


#: The projections whose outputs are a layer's keys and values, where a family names them apart.
KEY_VALUE = ("k_proj", "v_proj")


def kv_sharing(config, size: int) -> int:
    """How many of ``size`` ranks hold each KV head: 1 where the KV heads divide over the ranks, else
    ``size / KV heads`` (fewer KV heads than ranks: each rank computes its query heads' one KV head,
    the key and value projections whole on every rank). :class:`Unsharded` where the attention heads
    do not divide over the ranks, or the KV heads neither divide nor are divided by them."""
    family = config.model_type
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise Unsharded(f"{family}'s config names no num_attention_heads to divide over {size} ranks")
    if heads % size:
        raise Unsharded(
            f"{family} has {heads} attention heads, which do not divide over {size} ranks (tensor parallelism "
            "splits whole heads)"
        )
    if kv_heads % size == 0:
        return 1
    if size % kv_heads:
        raise Unsharded(
            f"{family} has {kv_heads} KV heads, which neither divide over {size} ranks nor divide them (a rank "
            "would hold part of a head)"
        )
    return size // kv_heads


def tp_plan(model: nn.Module, size: int) -> dict:
    """``{module path: ParallelStyle}`` sharding ``model`` over ``size`` ranks: its config's
    ``base_model_tp_plan`` under the base model, the embedding by vocabulary rows and the LM head by
    vocabulary columns, its logits gathered; :class:`Unsharded` for what cannot be applied."""
    config = model.config
    family = config.model_type
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        raise Unsharded(f"{family} declares no tensor-parallel layout (its config's base_model_tp_plan is empty)")
    shared = kv_sharing(config, size) > 1
    if shared and not any(pattern.endswith(KEY_VALUE) for pattern in declared):
        raise Unsharded(
            f"{family} has fewer KV heads than {size} ranks and no key and value projections of their own to "
            "hold whole on each rank"
        )
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = _path(model, model.base_model)
    plan = {}
    for pattern, style in declared.items():
        if style in REPLICATED or (shared and pattern.endswith(KEY_VALUE)):  # whole on each rank
            continue
        if style not in STYLES:
            raise Unsharded(f"{family}'s layout shards {pattern} as {style!r}, which this sampler does not apply")
        plan[f"{base}.{pattern}" if base else pattern] = _style(style)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    plan.setdefault(_path(model, embedding), RowwiseParallel(input_layouts=Replicate()))
    plan[_path(model, head)] = ColwiseParallel(output_layouts=Replicate())
    return plan


def parallelize(model: nn.Module, mesh, size: Optional[int] = None) -> nn.Module:
    """``model`` sharded in place over the 1-D ``mesh`` (:func:`tp_plan`); a tied LM head stays tied
    to the embedding (both are split by vocabulary rows, so one sharded tensor serves both). With
    fewer KV heads than ranks, each key and value projection returns this rank's one KV head only."""
    from torch.distributed.tensor.parallel import parallelize_module

    size = size or mesh.size()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, mesh, tp_plan(model, size))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    sharing = kv_sharing(model.config, size)
    if sharing > 1:
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_head = mesh.get_local_rank() // sharing  # the KV head of this rank's query heads
        columns = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in KEY_VALUE:
                module.register_forward_hook(lambda module, args, out: out[..., columns])
    return model
