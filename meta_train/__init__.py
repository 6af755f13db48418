"""Meta-training of the learned optimizer with Lightning.

Installed as ``learned_opt.meta_train``. Holds the ``MetaTrainModule``, the
gradient estimators (truncated backprop and antithetic PES), the task-seed data
module, the ``learned-opt-meta`` CLI and its YAML configs. Importing this package
imports nothing; its modules (``module``, ``data``, ``cli``) import Lightning, which the
core package never does.
"""
