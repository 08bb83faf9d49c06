"""The experience: prompts sampled and scored, responses, held-out evaluation.

What an iteration learns from: prompts sampled on the live weights and scored (``rollouts.py``),
what is done to the responses (``responses.py``), and the held-out evaluation (``evaluation.py``)."""
