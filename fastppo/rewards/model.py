"""A reward model as a reward function: a local Hugging Face sequence classifier whose first logit
scores prompt + completion, in batches without gradients.
"""

from pathlib import Path

import torch

from ..errors import UsageError
from ..hf import cast_parameters, load_complete


class RewardModel:
    """A local Hugging Face sequence-classification model as a reward function: the first logit of
    prompt + completion, scored in batches without gradients."""

    def __init__(self, path, device, dtype: torch.dtype = torch.float32, batch_size: int = 32):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not (Path(path) / "config.json").is_file():
            raise UsageError(f"--reward-model {path!r} is not a Hugging Face model directory (no config.json)")
        self.model = (
            load_complete(AutoModelForSequenceClassification, path, "--reward-model", "a sequence classifier")
            .to(device)
            .eval()
        )
        cast_parameters(self.model, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.device, self.batch_size = device, batch_size
        self.__qualname__ = f"RewardModel({path})"

    @torch.no_grad()
    def __call__(self, prompts, completions, **_):
        scores = []
        texts = [p + c for p, c in zip(prompts, completions)]
        for start in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            ).to(self.device)
            scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores
