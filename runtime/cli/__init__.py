"""The `hetps` command line (`main` wires the sub-commands of `model`, `train`, `tune`, `lifecycle`)."""
