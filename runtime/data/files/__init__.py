"""Real data for training: files in the formats CTR users have, read by a schema, sharded among
reader trainers, parsed vectorised (pyarrow; categoricals hashed by a compiled loop, numba) on a
background thread. See `open_dataset`."""

from runtime.data.files.dataset import Dataset, FileShard, open_dataset
from runtime.data.files.features import encode
from runtime.data.files.formats import FORMATS
from runtime.data.files.schema import Schema

__all__ = ["FORMATS", "Dataset", "FileShard", "Schema", "encode", "open_dataset"]
