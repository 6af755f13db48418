"""learned-opt: the project's commands, in one entry point.

  learned-opt list                                   shipped pretrained optimizers
  learned-opt export <lightning.ckpt> <out.pt>       deployable checkpoint from a run
  learned-opt inspect <checkpoint> [--logdir DIR]    card and response curves to TensorBoard
  learned-opt meta fit --config <yaml>               meta-train (same as learned-opt-meta)
  learned-opt train ...                              decentralized training (torchrun entry)
  learned-opt --version

export, inspect and meta need the meta extra, train the tasks extra; each command's
--help says more. (A thin dispatcher: each command is imported only when it runs. This
text is the --help, so it is plain text.)
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] in ("-V", "--version"):
        from learned_opt import __version__

        print(f"learned-opt {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "list":
        from learned_opt import list_pretrained

        print("\n".join(list_pretrained()))
        return 0
    if command in ("export", "inspect"):
        from learned_opt.checkpoint import CheckpointError
        from learned_opt.meta_train import cli

        try:
            return (cli.export_main if command == "export" else cli.inspect_main)(rest)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if command == "meta":
        from learned_opt.meta_train.cli import meta_cli_main

        meta_cli_main(rest)
        return 0
    if command == "train":
        from learned_opt.distributed.train import main as train_main

        train_main(rest)  # returns the run's summary, which is not an exit status
        return 0
    print(f"unknown command {command!r}; run 'learned-opt --help'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
