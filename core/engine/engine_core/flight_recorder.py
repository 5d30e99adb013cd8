"""The flight recorder (``observability.flight_recorder``): what an engine core accepted, scheduled and produced,
written off the step's critical path into size-capped segment files, so that ``engine replay`` can run the same
traffic again and compare every token and logprob.

Layout of a recording (one folder per data-parallel rank)::

    DIR/rank0/segment-000001.msgpack      frames: 4-byte little-endian length + one msgpack record
    DIR/rank0/incidents/<time>-<why>/     the segments kept whole when a request failed or the core died
    DIR/rank0/previous/<time>/            an earlier run's segments, moved aside when the engine starts again

Every segment begins with a :class:`RecordingHeader` (the resolved config, the plugins and their versions) and a
:class:`RequestRecord` for each request still running from an earlier segment (with the tokens it had), so any
segment can be replayed without the ones dropped before it. The engine core only builds each record and puts it on a
queue; a thread encodes, writes, rolls segments at a quarter of ``flight_recorder_max_bytes`` and deletes the oldest
beyond it.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import shutil
import struct
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import msgspec

from engine.lifetime import shutdown_at_exit
from engine.messages import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_LENGTH = struct.Struct("<I")


class RecordingHeader(msgspec.Struct, tag="header"):
    """The first record of every segment: enough to build the same engine again."""

    format_version: int
    config: dict[str, Any]  # VllmConfig.model_dump(mode="json")
    plugins: dict[str, str]  # kind -> the implementation chosen
    versions: dict[str, str]  # distribution -> version (the engine, torch, every plugin's distribution)
    dp_rank: int
    segment: int
    started: float  # wall-clock time the segment began


class RequestRecord(msgspec.Struct, tag="request"):
    """A request as the core accepted it, before step ``step`` ran; ``output_token_ids``: the tokens a request
    carried over from an earlier segment already had (empty for a new request)."""

    step: int
    request: EngineCoreRequest
    output_token_ids: list[int] = []


class AbortRecord(msgspec.Struct, tag="abort"):
    step: int
    request_ids: list[str]


class StepRecord(msgspec.Struct, tag="step"):
    """One applied step: the scheduler's decision (tokens per request, drafts verified, preemptions) and what it
    produced (new tokens, their logprobs where asked, finish reasons and errors)."""

    step: int
    scheduled: dict[str, int]
    drafts: dict[str, list[int]]
    outputs: list[EngineCoreOutput]
    preempted: list[str] = []  # requests this step's plan preempted (recomputed later)


Record = Union[RecordingHeader, RequestRecord, AbortRecord, StepRecord]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


def recording_header(vllm_config, plugins: dict[str, Any]) -> RecordingHeader:
    """The header of an engine core's recording: its resolved config, each plugin kind's implementation with the
    distribution and version it came from, and the engine's and torch's versions."""
    versions = {}
    for name in ("engine", "torch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "unknown"
    return RecordingHeader(
        FORMAT_VERSION,
        vllm_config.model_dump(mode="json"),
        {kind: f"{impl.name} ({impl.source})" for kind, impl in plugins.items()},
        versions,
        vllm_config.parallel.data_parallel_rank,
        0,
        time.time(),
    )


class FlightRecorder:
    """Records one engine core; ``step_done``, ``request_added`` and ``requests_aborted`` only queue."""

    def __init__(self, directory: str, max_bytes: int, header: RecordingHeader):
        self.folder = Path(directory) / f"rank{header.dp_rank}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = max(64 * 1024, max_bytes // 4)
        self.header = header
        self.step = 0  # steps applied so far
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # the writer's own state: the live requests and the tokens each has (carried into every new segment)
        self._live: dict[str, RequestRecord] = {}
        self._file: Any = None  # the open segment
        self._keep_previous_run()
        self._segment = 0
        self._written = 0
        self._thread = threading.Thread(target=self._write_loop, name="flight-recorder", daemon=True)
        self._thread.start()
        self._exit_hook = shutdown_at_exit(self)  # a script that simply ends still writes its last steps

    def _keep_previous_run(self) -> None:
        """A folder that holds an earlier run's segments (a restarted engine): they move to ``previous/<time>/``, so
        the rank folder holds one run, which replays alone."""
        old = self.segments()
        if not old:
            return
        target = self.folder / "previous" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(old[-1].stat().st_mtime))
        target.mkdir(parents=True, exist_ok=True)
        for path in old:
            path.rename(target / path.name)
        logger.info("flight recorder: the previous run's segments moved to %s", target)

    # ---- called by the engine core (cheap: build a record, queue it) ----
    def request_added(self, request: EngineCoreRequest) -> None:
        self._queue.put(RequestRecord(self.step, request))

    def requests_aborted(self, request_ids: list[str]) -> None:
        self._queue.put(AbortRecord(self.step, list(request_ids)))

    def step_done(
        self,
        scheduled: dict[str, int],
        drafts: dict[str, list[int]],
        outputs: list[EngineCoreOutput],
        preempted: Optional[list[str]] = None,
    ) -> None:
        """A step applied (``scheduled`` empty: outputs outside a step, such as requests refused or failed)."""
        self._queue.put(StepRecord(self.step, dict(scheduled), dict(drafts), list(outputs), list(preempted or ())))
        if scheduled:
            self.step += 1

    def incident(self, why: str) -> None:
        """Keep the current and the previous segment whole under ``incidents/`` (after everything queued so far)."""
        self._queue.put(("incident", why))

    def flush(self, timeout: float = 10.0) -> None:
        done = threading.Event()
        self._queue.put(("flush", done))
        done.wait(timeout)

    def close(self) -> None:
        """Write everything queued and close the segment (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=10)
        atexit.unregister(self._exit_hook)

    shutdown = close  # for shutdown_at_exit

    def segments(self) -> list[Path]:
        return sorted(self.folder.glob("segment-*.msgpack"))

    # ---- the writer thread ----
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    break
                if isinstance(item, tuple):
                    kind, arg = item
                    if self._file is not None:
                        self._file.flush()
                    if kind == "incident":
                        self._keep_incident(arg)
                    else:
                        arg.set()
                    continue
                if self._file is None or self._written >= self.segment_bytes:
                    self._open_segment(item.step)
                self._track(item)
                self._write(item)
                if self._queue.empty():  # caught up: hand the bytes to the OS (a killed core keeps them)
                    self._file.flush()
                if isinstance(item, StepRecord) and any(o.finish_reason == "error" for o in item.outputs):
                    failed = next(o.request_id for o in item.outputs if o.finish_reason == "error")
                    self._file.flush()
                    self._keep_incident(f"request {failed} failed")
            except Exception:  # the recorder must never take the engine down
                logger.exception("flight recorder: could not write a record")
        if self._file is not None:
            self._file.close()

    def _track(self, record: Record) -> None:
        if isinstance(record, RequestRecord):
            self._live[record.request.request_id] = RequestRecord(record.step, record.request, [])
        elif isinstance(record, AbortRecord):
            for request_id in record.request_ids:
                self._live.pop(request_id, None)
        elif isinstance(record, StepRecord):
            for output in record.outputs:
                live = self._live.get(output.request_id)
                if live is None:
                    continue
                if output.finish_reason is not None:
                    del self._live[output.request_id]
                else:
                    live.output_token_ids.extend(output.new_token_ids)

    def _write(self, record: Record) -> None:
        payload = _encoder.encode(record)
        self._file.write(_LENGTH.pack(len(payload)) + payload)
        self._written += _LENGTH.size + len(payload)

    def _open_segment(self, step: int) -> None:
        if self._file is not None:
            self._file.close()
        self._segment += 1
        path = self.folder / f"segment-{self._segment:06d}.msgpack"
        self._file = open(path, "wb")
        self._written = 0
        self._write(msgspec.structs.replace(self.header, segment=self._segment, started=time.time()))
        for live in self._live.values():  # requests running across the boundary, with the tokens they have
            self._write(RequestRecord(step, live.request, list(live.output_token_ids)))
        segments = self.segments()
        total = sum(p.stat().st_size for p in segments)
        for old in segments[:-1]:
            if total <= self.max_bytes:
                break
            total -= old.stat().st_size
            old.unlink()

    def _keep_incident(self, why: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        slug = "".join(c if c.isalnum() or c in "-_" else "-" for c in why)[:60]
        target = self.folder / "incidents" / f"{stamp}-{slug}"
        target.mkdir(parents=True, exist_ok=True)
        for path in self.segments()[-2:]:
            shutil.copyfile(path, target / path.name)
        (target / "WHY").write_text(why + "\n")
        logger.warning("flight recorder: %s; the recording around it is kept in %s", why, target)


def segment_number(path: Path) -> int:
    return int(path.stem.split("-")[1])


def read_segment(path: Path) -> Iterator[Record]:
    """The records of one segment file, in order (a torn last frame, from a core killed mid-write, is dropped)."""
    data = path.read_bytes()
    offset = 0
    while offset + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        if offset + length > len(data):
            break
        yield _decoder.decode(data[offset : offset + length])
        offset += length


def read_recording(folder: str | os.PathLike) -> list[Record]:
    """Every record of a rank folder's (or an incident folder's) segments, oldest first; a request carried into a
    later segment is kept from the first segment that has it."""
    paths = sorted(Path(folder).glob("segment-*.msgpack"))
    if not paths:
        raise FileNotFoundError(f"no flight-recorder segments (segment-*.msgpack) in {folder}")
    records: list[Record] = []
    seen: set[str] = set()
    for index, path in enumerate(paths):
        for record in read_segment(path):
            if isinstance(record, RecordingHeader) and index > 0:
                continue
            if isinstance(record, RequestRecord):
                if record.request.request_id in seen:
                    continue
                seen.add(record.request.request_id)
            records.append(record)
    return records
