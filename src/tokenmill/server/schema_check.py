"""JSON Schemas checked against their metaschema once per distinct schema, not once per request.

jsonschema's `check_schema` walks the draft 2020-12 metaschema through `$dynamicRef`s: 3-17 ms a
schema on the development and GPU hosts' CPUs, on the API server's event loop, where it holds up
every open stream. Clients send the same few schemas over and over (a `response_format` per
endpoint, an agent's tools every turn), so the schemas that passed are remembered by their
canonical JSON text (a bounded LRU); a schema that fails is checked again each time it comes, so
its 400 names the same problem every time and a stream of distinct bad schemas caches nothing.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import jsonschema
import jsonschema.validators

# Distinct valid schemas remembered, and the most text they may hold together (a schema is checked
# before any size limit applies, so a few huge ones must not pin much memory).
CACHE_SIZE = 512
CACHE_CHARS = 16 * 1024 * 1024


def canonical_text(schema: dict[str, Any] | bool) -> str:
    """The schema's JSON text with its keys sorted: equal JSON values, equal texts (validity under
    the metaschema depends only on the value)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class SchemaChecker:
    """`check(schema)` raises jsonschema.SchemaError for a schema that is not a valid JSON Schema;
    a schema that passed once passes again without the metaschema walk."""

    def __init__(self, capacity: int = CACHE_SIZE, max_chars: int = CACHE_CHARS) -> None:
        self.capacity = capacity
        self.max_chars = max_chars
        self._chars = 0
        self._valid: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # handlers may run on worker threads (tokenize_off_loop)
        self.hits = 0
        self.checks = 0  # metaschema walks (misses, and every invalid schema)

    def check(self, schema: dict[str, Any] | bool) -> None:
        key = canonical_text(schema)
        with self._lock:
            if key in self._valid:
                self._valid.move_to_end(key)
                self.hits += 1
                return
            self.checks += 1
        # The original object, not the parsed key: the error names the same path either way, and
        # jsonschema reports the first error in the client's own key order.
        jsonschema.validators.validator_for(schema).check_schema(schema)
        if len(key) > self.max_chars:
            return
        with self._lock:
            if key not in self._valid:
                self._chars += len(key)
            self._valid[key] = None
            self._valid.move_to_end(key)
            while len(self._valid) > self.capacity or self._chars > self.max_chars:
                old, _ = self._valid.popitem(last=False)
                self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._valid)


# One per API server process: response_format / structured_outputs / guided_json schemas and tool
# parameter schemas share it.
SCHEMAS = SchemaChecker()
