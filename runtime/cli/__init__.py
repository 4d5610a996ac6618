"""The `hetps` command line: `app` holds the parser and `main` (the console script `hetps`, also
`python -m runtime.cli`); the sub-commands live by group in `model` (transpile, inspect, draw, export),
`train` (train, bench, plot), `tune` (tune, inspect --predict) and `lifecycle` (eval, predict, export
--inference, checkpoint options); `common` holds what they share."""

from runtime.cli.app import main

__all__ = ["main"]
