"""The models: loading, the critic, LoRA, precision and the sampler's weights.

The shipped default (``default.py``), the policy loaded and checked (``loading.py``), its weights
made ready and saved (``weights.py``), the critic (``critic.py``), LoRA (``lora.py``), the precision
of each copy (``precision.py``), the sampler's copy (``rollout_weights.py``) and giving freed host
memory back (``host_memory.py``)."""
