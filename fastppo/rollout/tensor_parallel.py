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
to the heads its projections return. What is refused, in one line naming it: a family with no
plan, a plan style this does not apply (expert parallelism, packed projections), and heads, KV
heads included, that do not divide over N (a rank would hold part of a head).
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


def check_divisible(config, size: int) -> None:
    """Raise :class:`Unsharded` where ``config``'s heads do not divide over ``size`` ranks."""
    family = config.model_type
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None:
        raise Unsharded(f"{family}'s config names no num_attention_heads to divide over {size} ranks")
    for what, count in (("attention heads", heads), ("KV heads", kv_heads)):
        if count % size:
            raise Unsharded(
                f"{family} has {count} {what}, which do not divide over {size} ranks (tensor parallelism "
                "splits whole heads)"
            )


def tp_plan(model: nn.Module, size: int) -> dict:
    """``{module path: ParallelStyle}`` sharding ``model`` over ``size`` ranks: its config's
    ``base_model_tp_plan`` under the base model, the embedding by vocabulary rows and the LM head by
    vocabulary columns, its logits gathered; :class:`Unsharded` for what cannot be applied."""
    config = model.config
    family = config.model_type
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        raise Unsharded(f"{family} declares no tensor-parallel layout (its config's base_model_tp_plan is empty)")
    check_divisible(config, size)
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = _path(model, model.base_model)
    plan = {}
    for pattern, style in declared.items():
        if style in REPLICATED:
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
    to the embedding (both are split by vocabulary rows, so one sharded tensor serves both)."""
    from torch.distributed.tensor.parallel import parallelize_module

    size = size or mesh.size()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, mesh, tp_plan(model, size))
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model
