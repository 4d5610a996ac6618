"""`NatsStreamSource`: records from a NATS JetStream stream (the log stream PERSIA / Monolith
style trainers consume), read by a pull consumer as training asks for batches.

Payload format: JSON Lines — each message holds one or more records, one JSON object per line,
keyed by column name (`{"click": 1, "price": 3.5, "user": "u17"}`); categorical values are JSON
strings. A record that does not parse, or that the schema refuses (a missing label), is skipped and
counted (`malformed`, the last reason in `last_malformed`).

Position: the last stream sequence read whole and the records of the next message yielded;
`seek` starts a consumer at the sequence after it (`deliver_policy=by_start_sequence`). The
consumer is ephemeral and disposable: the source's own position is the truth, so after a
reconnect, or a consumer the server lost, a new one starts where the source is. The client
(`nats-py`, asyncio) runs on a private event-loop thread, so the source's API is synchronous.

Back-pressure: a fetch asks the server for at most `local batch size` messages, and only when
a batch is asked for: nothing is buffered beyond one fetch. Reader shards: reader i of n keeps the
messages whose stream sequence is i mod n (every reader fetches the stream; each record is trained
by one). For a partitioned stream, give each reader its own subject instead (shard (0, 1)).

A broker that goes away is reconnected to; one unreachable for `reconnect_timeout` s raises
`StreamStalled` naming the servers. `follow=False` ends at the stream's last message (as of the
first fetch); with `follow`, `timeout` s without a new message raise `StreamStalled`. Passes:
windows of `pass_seconds` of the messages' JetStream timestamps; a pass ends when a message of a
later window arrives.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import numpy as np
import pyarrow as pa

from ops_registry.errors import HetpsError
from runtime.data.files import formats
from runtime.data.files.dataset import _joined, column_types
from runtime.data.streams.base import Feed, Pass, StreamPosition, StreamSource, StreamStalled, marked, rebatch


class NoAnswer(HetpsError):
    """A call on the event-loop thread did not finish in time."""


class _Loop:
    """An asyncio event loop on a daemon thread; `run(coro)` waits for the coroutine's result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="hetps-nats", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        """The coroutine's result; `NoAnswer` when it has none after `timeout` s (it is cancelled)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the coroutine's own timeout
                raise
            future.cancel()
            raise NoAnswer from None

    def stop(self) -> None:
        """Cancel the loop's tasks (the client's readers), stop it and join its thread."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout=5)
        except (Exception, NoAnswer):  # stopping regardless
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


class NatsStreamSource(StreamSource):
    """See the module docstring. `stream`: the JetStream stream; `subject`: the subject (filter) to
    read; `servers`: nats:// URLs. Use it as a context manager, or `close()` it."""

    kind = "nats"

    def __init__(
        self,
        stream: str,
        subject: str,
        schema: Any,
        batch_size: int,
        *,
        servers: str | list[str] = "nats://127.0.0.1:4222",
        shard: tuple[int, int] = (0, 1),
        follow: bool = True,
        timeout: float | None = None,
        reconnect_timeout: float = 30.0,
        fetch_wait: float = 0.5,
        pass_seconds: float = 3600.0,
    ) -> None:
        super().__init__(schema, batch_size, shard)
        self.stream, self.subject = stream, subject
        self.servers = [servers] if isinstance(servers, str) else list(servers)
        self.follow, self.timeout, self.reconnect_timeout = follow, timeout, reconnect_timeout
        self.fetch_wait, self.pass_seconds = fetch_wait, pass_seconds
        self.types = column_types(self.schema, self.schema.columns)
        self.malformed = 0
        self.last_malformed = ""
        self._position = StreamPosition(self.kind, self.shard)
        self._loop: _Loop | None = None
        self._nc = None
        self._reconnects = 0

    def position(self) -> StreamPosition:
        return self._position

    def _seek(self, position: StreamPosition) -> None:
        self._position = position

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_loop": None, "_nc": None}

    def __enter__(self) -> NatsStreamSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection and stop the event-loop thread."""
        if self._loop is not None:
            if self._nc is not None:
                try:
                    self._loop.run(self._nc.close(), timeout=5)
                except Exception:  # closing a connection to a server that is gone
                    pass
            self._loop.stop()
        self._loop, self._nc = None, None

    def passes(self) -> Iterator[Pass]:
        groups = self._groups()
        box = [next(groups, None)]
        while box[0] is not None:
            window = box[0][0]
            start = datetime.fromtimestamp(window * self.pass_seconds, timezone.utc)

            def chunks(window: int = window) -> Iterator[Feed]:
                while box[0] is not None and box[0][0] == window:
                    yield box[0][1]
                    box[0] = next(groups, None)

            yield Pass(
                start.isoformat(), start, start + timedelta(seconds=self.pass_seconds), self._emit(chunks())
            )
            if box[0] is not None and box[0][0] == window:
                raise RuntimeError(
                    f"pass {start.isoformat()} was left before its last batch: read it to the end"
                )

    # -- internals ----------------------------------------------------------------------------
    def _emit(self, chunks: Iterator[Feed]) -> Iterator[Feed]:
        for feed, sequence, row in rebatch(chunks, self.local_batch):
            self._position = StreamPosition(self.kind, self.shard, sequence=sequence, row=row)
            yield feed

    def _groups(self) -> Iterator[tuple[int, Feed]]:
        """(time window, marked feed of its records) of consecutive messages of one window."""
        done, skip = self._position.sequence, self._position.row
        for msgs in self._fetches(done):
            windows = [int(m.metadata.timestamp.timestamp() // self.pass_seconds) for m in msgs]
            at = 0
            while at < len(msgs):
                end = at + 1
                while end < len(msgs) and windows[end] == windows[at]:
                    end += 1
                feed = self._records(msgs[at:end], done, skip)
                done, skip = msgs[end - 1].metadata.sequence.stream, 0
                if feed is not None:
                    yield windows[at], feed
                at = end

    def _records(self, msgs: list, done: int, skip: int) -> Feed | None:
        """The marked feed of this shard's records of `msgs` (the first message's first `skip`
        records already read), malformed ones counted and left out."""
        lines, unit, row = [], [], []
        i, n = self.shard
        for m in msgs:
            seq = m.metadata.sequence.stream
            if seq % n == i:
                mine = [x for x in m.data.split(b"\n") if x.strip()]
                first = skip if m is msgs[0] else 0  # `skip`: records of the position's next message
                for k in range(first, len(mine)):
                    lines.append(mine[k])
                    last = k == len(mine) - 1
                    unit.append(seq if last else done)
                    row.append(0 if last else k + 1)
            done = seq
        if not lines:
            return None
        feed, good = self._parse(lines)
        return None if feed is None else marked(feed, np.array(unit)[good], np.array(row)[good])

    def _parse(self, lines: list[bytes]) -> tuple[Feed | None, np.ndarray]:
        """(feed of the records that parse, which did): all at once, else record by record."""
        try:
            return self._feed(lines), np.ones(len(lines), bool)
        except (ValueError, pa.ArrowException):
            pass
        feeds, good = [], np.zeros(len(lines), bool)
        for k, line in enumerate(lines):
            try:
                feeds.append(self._feed([line]))
                good[k] = True
            except (ValueError, pa.ArrowException) as e:
                self.malformed += 1
                self.last_malformed = f"{line[:200]!r}: {e}"
        return (_joined(feeds) if feeds else None), good

    def _feed(self, lines: list[bytes]) -> Feed:
        cols = formats.json_columns(b"\n".join(lines) + b"\n", self.types)
        if len(cols[self.schema.label]) != len(lines):
            raise ValueError(f"{len(lines)} lines gave {len(cols[self.schema.label])} records")
        return self.schema.feeds(cols)

    def _fetches(self, done: int) -> Iterator[list]:
        """Lists of messages after sequence `done`, fetched as they are asked for."""
        import nats.errors

        self._connect()
        sub, made_at, end, idle, failing = None, -1, None, time.monotonic(), None
        try:
            while True:
                if sub is None or made_at != self._reconnects:  # after a reconnect: a new consumer
                    sub, made_at = self._call(self._subscribe(done, sub)), self._reconnects
                if end is None and not self.follow:
                    end = self._call(self._last_sequence())
                if end is not None and done >= end:
                    return
                try:
                    msgs = self._call(sub.fetch(self.local_batch, timeout=self.fetch_wait))
                except nats.errors.TimeoutError:
                    msgs = []
                except Exception as e:  # the connection or the consumer is gone: make another
                    failing = failing or time.monotonic()
                    if time.monotonic() - failing > self.reconnect_timeout:
                        raise StreamStalled(
                            f"cannot fetch from stream {self.stream} on {self.servers} for "
                            f"{self.reconnect_timeout} s: {e!r}"
                        ) from e
                    self._wait_connected(e)
                    made_at = -1
                    continue
                failing = None
                msgs = [m for m in msgs if m.metadata.sequence.stream > done]
                if msgs:
                    idle = time.monotonic()
                    done = msgs[-1].metadata.sequence.stream
                    yield msgs
                elif not self.follow and end is not None:
                    return
                elif self.timeout is not None and time.monotonic() - idle > self.timeout:
                    raise StreamStalled(
                        f"no new message on {self.subject} (stream {self.stream}, servers {self.servers}) "
                        f"after sequence {done} for {self.timeout} s"
                    )
        finally:
            if sub is not None and self._loop is not None:
                try:
                    self._loop.run(sub.unsubscribe(), timeout=2)
                except (Exception, NoAnswer):  # the consumer expires on the server by itself
                    pass

    def _call(self, coro):
        try:
            return self._loop.run(coro, timeout=self.reconnect_timeout + 10)
        except NoAnswer:
            raise StreamStalled(
                f"NATS server(s) {self.servers} did not answer for {self.reconnect_timeout + 10} s"
            ) from None

    def _wait_connected(self, error: Exception) -> None:
        t0 = time.monotonic()
        while not self._nc.is_connected:
            if time.monotonic() - t0 > self.reconnect_timeout:
                raise StreamStalled(
                    f"NATS server(s) {self.servers} unreachable for {self.reconnect_timeout} s "
                    f"(stream {self.stream}); last error: {error!r}"
                ) from error
            time.sleep(0.05)
        time.sleep(0.05)

    async def _subscribe(self, done: int, old):
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        if old is not None:
            try:
                await old.unsubscribe()
            except Exception:  # a subscription of a connection that was reset
                pass
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=done + 1,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
        )
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                return await self._nc.jetstream().pull_subscribe(
                    self.subject, stream=self.stream, config=config
                )
            except Exception as e:  # JetStream not back yet after a restart
                if time.monotonic() > deadline:
                    raise StreamStalled(
                        f"cannot read stream {self.stream} ({self.subject}) on {self.servers}: {e!r}"
                    ) from e
                await asyncio.sleep(0.1)

    async def _last_sequence(self) -> int:
        info = await self._nc.jetstream().stream_info(self.stream)
        return int(info.state.last_seq)

    def _connect(self) -> None:
        if self._nc is not None:
            return
        import nats

        self._loop = self._loop or _Loop()

        async def reconnected() -> None:
            self._reconnects += 1

        async def quiet(e: Exception) -> None:  # errors surface as the calls' errors
            pass

        async def connect():
            return await nats.connect(
                self.servers,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.1,
                connect_timeout=2,
                reconnected_cb=reconnected,
                error_cb=quiet,
            )

        t0 = time.monotonic()
        while self._nc is None:
            try:
                self._nc = self._loop.run(connect(), timeout=self.reconnect_timeout)
            except (Exception, NoAnswer) as e:
                if time.monotonic() - t0 > self.reconnect_timeout:
                    raise StreamStalled(
                        f"cannot connect to the NATS server(s) {self.servers} for "
                        f"{self.reconnect_timeout} s: {e!r}"
                    ) from e
                time.sleep(0.2)
