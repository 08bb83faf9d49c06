"""What glibc's heap does with freed tensor memory under each choice of ``host_memory.py``, measured
on processes of their own (the choice is a process's for good); the peak that releasing cuts is
measured in ``tests/trainer/memory/test_plan.py``."""

import subprocess
import sys

import pytest

UPDATES = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastppo.trainer.modeling import host_memory

if sys.argv[1] != "default":
    assert getattr(host_memory, sys.argv[1] + "_freed_memory")()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
ids = torch.randint(0, 8000, (8, 300))  # logits of 77 MB: above glibc's largest raised threshold
faults = []
for step in range(8):  # the same update again, as iterations bring
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(input_ids=ids, labels=ids).loss.backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def _faults(choice: str) -> int:
    """Page faults of the last six of eight equal updates in a fresh process."""
    out = subprocess.run([sys.executable, "-c", UPDATES, choice], capture_output=True, text=True, check=True).stdout
    return int(out.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_serves_the_next_updates_without_fresh_page_faults():
    faults = {choice: _faults(choice) for choice in ("default", "keep", "release")}
    assert faults["default"] > 10_000, faults  # the logits and their gradients mapped afresh each time
    assert faults["release"] > 10_000, faults
    # kept: none, but where the heap grows once more (a large block it could not fit among the freed ones)
    assert faults["keep"] < 0.15 * faults["default"], faults
