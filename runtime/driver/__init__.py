"""The driver of a run: `train` (starts the processes, runs the listener loop), its settings, the
pauses between steps (checkpoints, evaluation), checkpoints on disk and the `History` it returns."""
