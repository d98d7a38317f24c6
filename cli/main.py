"""The `sparrow` command line.

    sparrow demo                 a fresh world video -> the committed world pair -> streamed answers + speed
    sparrow demo --long          the same on a ~25k-visual-token video, with plain vs EAGLE-style vs Sparrow
    sparrow serve [--ray]        the gRPC service (embedded: grpc.aio + in-process engine;
                                 --ray: Ray Serve, the target as a deployment, and the draft as its
                                 own deployment with --draft-placement remote)
    sparrow generate --server HOST:PORT VIDEO "question"    stream an answer from a server
    sparrow live --server HOST:PORT SOURCE    play a file (or have the server read a URL) into a live
                                 session; standing questions and timed questions, answers as they stream
    sparrow train-draft ...      train a Sparrow draft for a target (sparrow.training)
    sparrow world ...            the synthetic world: make-data, train-target, train-draft, eval, demo

Every command takes --verbose (third-party progress bars and notices, which are off otherwise).
"""
from __future__ import annotations

import argparse
import sys

from sparrow.errors import InvalidRequest

from sparrow.cli import demo, generate, live, serve


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; with `command` (the one about to run), the training commands' options
    (their configs live beside torch code) are built only when it is one of them, so a client
    command (`sparrow generate`, `sparrow live`) starts without importing torch."""
    from sparrow.progress import verbose_option
    from sparrow.training.commands import TRAINING_COMMANDS, add_commands as _add_training

    parser = argparse.ArgumentParser(prog="sparrow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    common = verbose_option()
    for module in (demo, serve, generate, live):
        module.add_command(sub, common)
    _add_training(sub, common, options=command is None or command in TRAINING_COMMANDS)   # train-draft, world
    return parser


def main(argv: list[str] | None = None) -> int:
    from sparrow.progress import quiet_third_party

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and not argv[0].startswith("-") else None).parse_args(argv)
    quiet_third_party(args.verbose)
    try:
        return args.func(args)
    except InvalidRequest as exc:         # a request the command cannot honour: say why, no traceback
        print(f"sparrow {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
