"""Task library: the training problems used for meta-training, evaluation and demos.

Installed as ``learned_opt.tasks``. Each task has a functional face (``init``,
pure ``loss``, usable under ``torch.func.vmap``) and a module face (an
``nn.Module`` plus batches). Families sample random tasks. Data ships offline
(scikit-learn datasets, synthetic data, ``pydoc_data.topics``); nothing is
downloaded. Imports torch, numpy and scikit-learn only.
"""
