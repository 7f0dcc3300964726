"""The API server's half of the trace (`--trace-dir`): requests.jsonl.

One line per finished engine sequence: its id, the engine's `RequestTimeline` (sent with its last
output), and this process's own times: `api_first_output` (its first token was processed here, on
its way to the client's stream) and `api_finished`. Lines of kind "gc" are this process's
garbage-collection pauses. Times are `time.monotonic()` (see core/request_timeline.py).
"""

from __future__ import annotations

import msgspec

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.gc_pauses import GcPauses
from tokenmill.engine.trace_files import REQUESTS_FILE, open_trace_file


class RequestTraceLog:
    def __init__(self, trace_dir: str) -> None:
        self._file = open_trace_file(trace_dir, REQUESTS_FILE)
        self._encoder = msgspec.json.Encoder()
        self._first_output: dict[str, float] = {}
        self._gc = GcPauses()

    def output(self, out: EngineCoreOutput, now: float) -> None:
        if out.new_token_ids and out.request_id not in self._first_output:
            self._first_output[out.request_id] = now
        if not out.finished:
            return
        first = self._first_output.pop(out.request_id, None)
        record: dict = {"kind": "request", "id": out.request_id, "finish_reason": out.finish_reason}
        if out.timeline is not None:
            record |= msgspec.structs.asdict(out.timeline)
        record["api_first_output"] = first
        record["api_finished"] = now
        lines = [self._encoder.encode(record)]
        for start, seconds, generation in self._gc.drain():
            lines.append(self._encoder.encode({"kind": "gc", "start": start, "seconds": seconds, "generation": generation}))
        # One write and flush per finished request: a benchmark reads the file as soon as it ends.
        self._file.write(b"\n".join(lines) + b"\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._gc.close()
