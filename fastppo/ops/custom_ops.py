"""What the custom ops' autograd registrations share: their inputs by name, read from each op's
schema, and a backward's gradients in that order. Autograd hands a custom op's inputs over as a
tuple and wants one gradient (or None) per input back; naming them keeps both in step with the
op's signature."""


def input_names(op) -> tuple:
    """The names of ``op``'s inputs (``torch.ops.fastppo.<name>.default``), in order."""
    return tuple(argument.name for argument in op._schema.arguments)


def gradients(names: tuple, **grads) -> tuple:
    """A backward's return: the gradient of each input in ``names``, None where ``grads`` has none."""
    return tuple(grads.get(name) for name in names)
