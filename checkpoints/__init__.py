"""Shipped pretrained learned optimizers (``*.pt``) and their model cards.

Installed as ``learned_opt.checkpoints``; ``learned_opt.list_pretrained()`` lists them.
"""
