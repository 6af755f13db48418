"""``python -m learned_opt.meta_train.cli_entry`` runs the ``learned-opt-meta`` LightningCLI."""

from .cli import meta_cli_main

if __name__ == "__main__":
    meta_cli_main()
