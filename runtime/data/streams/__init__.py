"""Sources that never end, with offsets: pass directories (`PassDirectorySource`) and a NATS
JetStream stream (`NatsStreamSource`, needs `nats-py`), behind one interface (`StreamSource`:
`passes()`, `batches()`, `position()`, `seek()`); see base.py."""

from runtime.data.streams.base import Pass, StreamPosition, StreamSource, StreamStalled
from runtime.data.streams.passes import PassDirectorySource

__all__ = [
    "NatsStreamSource",
    "Pass",
    "PassDirectorySource",
    "StreamPosition",
    "StreamSource",
    "StreamStalled",
]


def __getattr__(name: str):
    """`NatsStreamSource` is imported on first use (nats-py)."""
    if name == "NatsStreamSource":
        from runtime.data.streams.nats import NatsStreamSource

        return NatsStreamSource
    raise AttributeError(f"module 'runtime.data.streams' has no attribute {name!r}")
