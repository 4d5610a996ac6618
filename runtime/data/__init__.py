"""Data for training: synthetic CTR data from a hidden teacher (`synthetic`), what a reader trainer
reads (`sources`), click-log files read by a schema (`files/`: `open_dataset`), sources that never
end, read from a saved position (`streams/`: pass directories, NATS JetStream), and CTR models built
from a schema's feeds (`models`)."""

from runtime.data.synthetic import ArrayReader, CriteoReader, SyntheticCTR, SyntheticMultiTask

__all__ = [
    "ArrayReader",
    "CriteoReader",
    "Dataset",
    "Schema",
    "SyntheticCTR",
    "SyntheticMultiTask",
    "encode",
    "open_dataset",
]


def __getattr__(name: str):
    """`open_dataset`, `Dataset`, `Schema` and `encode` live in runtime.data.files (imported on first
    use: pyarrow)."""
    if name in ("open_dataset", "Dataset", "Schema", "encode"):
        from runtime.data import files

        return getattr(files, name)
    raise AttributeError(f"module 'runtime.data' has no attribute {name!r}")
