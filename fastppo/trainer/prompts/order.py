"""The epoch order: a fresh permutation of the prompts each epoch, read from any position, so a
resumed run draws the prompts the uninterrupted run would have.
"""

import random


class EpochOrder:
    """Indices into ``count`` prompts in shuffled epochs: position ``p`` of the stream is
    ``permutation(p // count)[p % count]``, each epoch's permutation drawn from ``(seed, epoch)``."""

    def __init__(self, count: int, seed: int):
        self.count, self.seed = count, seed
        self._epoch, self._permutation = None, None

    def take(self, start: int, k: int) -> list:
        """The indices at stream positions ``start .. start + k - 1`` (crossing epochs as needed)."""
        return [self._at(p) for p in range(start, start + k)]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.count)
        if epoch != self._epoch:
            order = list(range(self.count))
            random.Random(f"fastppo prompts {self.seed} {epoch}").shuffle(order)
            self._epoch, self._permutation = epoch, order
        return self._permutation[offset]
