"""CUDA graphs of the lean decode step: one launch per step instead of hundreds.

A graph is captured on first use for each (rows, span bucket), rows and spans rounded up to powers
of two (``graph_rows``: the batching loop runs that many slots, the ones past its batch free), so
a rollout needs about log2(max_batch_size) x log2(max_seq_len) of them. Replays read the model's
parameters at the addresses they had at capture: optimizer steps update them in place, so the
next rollout sees the new weights; replacing the parameter tensors themselves needs a new Sampler.

Warm-up and capture write keys and values at the bucket's last position, ``bucket - 1``. That is
harmless: every row is at or before that position when a graph is first needed (its span falls
in the bucket), and a slot at or past a row's position is always rewritten by the step that
first reads it.

A step that waits on the host cannot be captured: a model's own MoE blocks often ask which experts
their tokens chose (``nonzero``) before running them. The warm-up runs under CUDA's sync check
(``torch.cuda.set_sync_debug_mode("error")``); a step that syncs is then replayed never and run
eagerly, and the log says why.
"""

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def graph_rows(rows: int) -> int:
    """The slots one graph replay decodes for a batch of ``rows``: the next power of two."""
    return 1 << (rows - 1).bit_length()


class DecodeGraphs:
    def __init__(self, decoder):
        self.decoder = decoder
        self.max_len = decoder.cache.max_len
        self.graphs = {}
        self.pool = None
        #: Why the step runs eagerly (it waits on the host), or None while it is replayed.
        self.eager = None

    def decode(self, tokens: Tensor, positions: Tensor, span: int, live: Tensor = None) -> Tensor:
        """The cached decoder's step, replayed; ``live`` is not read (a cached decoder reads none)."""
        bucket = min(1 << (span - 1).bit_length(), self.max_len)
        key = (tokens.shape[0], bucket)
        if key not in self.graphs and self.eager is None:
            self.graphs[key] = self._capture(*key)
        if self.eager is not None:
            return self.decoder.decode(tokens, positions, span, live)
        graph, static_tokens, static_positions, logits = self.graphs[key]
        static_tokens.copy_(tokens)
        static_positions.copy_(positions)
        graph.replay()
        return logits

    def _capture(self, rows: int, span: int):
        device = self.decoder.cache.k[0].device
        tokens = torch.zeros(rows, dtype=torch.long, device=device)
        positions = torch.full((rows,), span - 1, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        checking = torch.cuda.get_sync_debug_mode()
        with torch.cuda.stream(side):
            try:  # warm-up: allocations and library handles, and no wait on the host
                torch.cuda.set_sync_debug_mode("error")
                self.decoder.decode(tokens, positions, span, None)
            except RuntimeError as error:
                self.eager = f"its decode step waits on the host ({str(error).splitlines()[0]})"
            finally:
                torch.cuda.set_sync_debug_mode(checking)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.eager is not None:
            logger.info("CUDA graphs: off, as %s", self.eager)
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.decoder.decode(tokens, positions, span, None)
        self.pool = graph.pool()
        return graph, tokens, positions, logits
