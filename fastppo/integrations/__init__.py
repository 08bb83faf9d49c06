"""fastppo's kernels behind the signatures other trainers already call.

One module per trainer; importing one never imports the trainer itself.
"""
