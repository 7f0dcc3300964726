"""Schema-driven fuzzing of the HTTP API with schemathesis, from the app's own /openapi.json.

schemathesis reads the schema the app publishes (request bodies generated from protocol.py's
models, see server/openapi.py) and generates requests for every operation: positive ones (valid by
the schema) and, where there is a body, negative ones (breaking the schema somewhere). The real
FastAPI app answers them in-process, called by schemathesis as an ASGI app, over the scripted
FakeEngine (no model, no subprocess). For every request: no 5xx (schemathesis's
`not_a_server_error`) and every error in OpenAI's body, in streams too; after every request
/health still answers 200. After each operation: nothing is left running in the engine, no request
ended with finish_reason "error", and the run was not vacuous (some requests succeeded and, for
generation, reached the engine).

test_fuzz_api.py keeps the hand-written hypothesis strategies against a real model server; this
one follows the published schema, so it also covers what the schema says and they do not.

CI runs a fixed, derandomized example set. Explore further with
TOKENMILL_FUZZ_RANDOM=1 TOKENMILL_FUZZ_EXAMPLES=500 pytest tests/reliability/test_schemathesis.py
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from starlette.types import ASGIApp, Receive, Scope, Send

from tests.reliability.server_tools import openai_error_problem
from tests.server.fake_engine import FakeEngine, fake_server_state
from tokenmill import envs
from tokenmill.server.api_server import create_app
from tokenmill.server.state import ServerState

# Per operation, positive and negative cases together: about 15 s for the whole file on 2 cores.
DEFAULT_EXAMPLES = 60
EXAMPLES = envs.TOKENMILL_FUZZ_EXAMPLES.get() or DEFAULT_EXAMPLES
# A request still unanswered after this long is a hang, and fails the test.
CALL_TIMEOUT_S = 10.0

OPERATIONS = [
    "GET /health",
    "GET /version",
    "GET /metrics",
    "GET /v1/models",
    "POST /tokenize",
    "POST /detokenize",
    "POST /v1/completions",
    "POST /v1/chat/completions",
]
GENERATION = {"POST /v1/completions", "POST /v1/chat/completions"}


class _EngineLifespan:
    """The app, plus an ASGI lifespan that starts the fake engine on the event loop that will serve
    it: schemathesis calls the app from an event loop of its own, in another thread, and runs the
    lifespan there first."""

    def __init__(self, app: ASGIApp, engine: FakeEngine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        assert (await receive())["type"] == "lifespan.startup"
        await self.engine.start()
        await send({"type": "lifespan.startup.complete"})
        assert (await receive())["type"] == "lifespan.shutdown"
        await self.engine.shutdown()
        await send({"type": "lifespan.shutdown.complete"})


@dataclass
class Api:
    schema: schemathesis.BaseSchema
    app: _EngineLifespan
    state: ServerState
    engine: FakeEngine


@pytest.fixture
def api() -> Iterator[Api]:
    """A fresh app and engine per test: schemathesis's pytest plugin ends the app's lifespan (and so
    stops the engine) when each test ends."""
    engine = FakeEngine()
    state = fake_server_state(engine)
    app = _EngineLifespan(create_app(state), engine)
    yield Api(schemathesis.openapi.from_asgi("/openapi.json", app), app, state, engine)
    # Stops the engine on schemathesis's loop, unless the plugin (when enabled) already did.
    schemathesis.python.asgi.shutdown_lifespans()


def openai_error_body(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    """Every error, as a response or as an event in a stream, has OpenAI's error body; no stream
    event carries a 5xx."""
    content_type = (response.headers.get("content-type") or [""])[0]
    if response.status_code >= 400:
        try:
            body = json.loads(response.content)
        except ValueError as exc:
            raise AssertionError(
                f"status {response.status_code}: the body is not JSON: {response.content[:300]!r}"
            ) from exc
        problem = openai_error_problem(body, response.status_code)
        assert problem is None, problem
    elif content_type.startswith("text/event-stream"):
        for line in response.content.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                code = event["error"].get("code")
                assert openai_error_problem(event, code) is None, event
                assert not (isinstance(code, int) and code >= 500), f"a {code} error event: {event}"


def strategy(api: Api, label: str) -> st.SearchStrategy[schemathesis.Case]:
    method, path = label.split(" ", 1)
    operation = api.schema[path][method]
    cases = operation.as_strategy(GenerationMode.POSITIVE)
    if operation.body:  # with nothing to break, a negative case cannot exist
        cases = st.one_of(cases, operation.as_strategy(GenerationMode.NEGATIVE))
    return cases


def finished_with_error(state: ServerState) -> float:
    for line in state.metrics.render().decode().splitlines():
        if line.startswith("tokenmill:request_success_total") and 'finished_reason="error"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("tokenmill:request_success_total{finished_reason=error} is not exported")


def wait_for(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:.0f} s"
        time.sleep(0.01)


def test_the_schema_lists_every_operation_with_its_request_body(api: Api) -> None:
    labels = sorted(f"{op.ok().method.upper()} {op.ok().path}" for op in api.schema.get_all_operations())
    assert labels == sorted(OPERATIONS), "an operation is missing from OPERATIONS (or the schema)"
    for label in OPERATIONS:
        method, path = label.split(" ", 1)
        assert bool(api.schema[path][method].body) == (method == "POST"), label


@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_error_for_any_generated_request(api: Api, label: str) -> None:
    health = api.schema["/health"]["GET"]
    statuses: Counter[int] = Counter()
    reached_engine_before = len(api.engine.core.added)

    @given(case=strategy(api, label))
    @settings(
        max_examples=EXAMPLES,
        derandomize=not envs.TOKENMILL_FUZZ_RANDOM.get(),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call(timeout=CALL_TIMEOUT_S)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error, openai_error_body])
        after = health.Case().call(timeout=CALL_TIMEOUT_S)
        assert after.status_code == 200, f"/health {after.status_code} after {case.as_curl_command()}"

    fuzz()

    print(f"{label}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert any(200 <= s < 300 for s in statuses), f"no request succeeded: {statuses}"
    if label.startswith("POST"):
        assert any(400 <= s < 500 for s in statuses), f"no request was refused: {statuses}"
    if label in GENERATION:
        assert len(api.engine.core.added) > reached_engine_before, "no generated request reached the engine"
    # Streams cut short by schemathesis are aborted as their response is cancelled.
    wait_for(lambda: api.engine.num_unfinished == 0 and not api.engine.core.running, "nothing running")
    assert finished_with_error(api.state) == 0


def test_undeclared_methods_get_405_with_allow(api: Api) -> None:
    """Found by schemathesis (`unsupported_method`, with the coverage phase of `st run`): a 405 came
    without the `Allow` header RFC 9110 requires."""
    declared: dict[str, set[str]] = {}
    for label in OPERATIONS:
        method, path = label.split(" ", 1)
        declared.setdefault(path, set()).add(method)
    with schemathesis.python.asgi.get_client(api.app) as client:
        for path, methods in declared.items():
            for method in sorted({"GET", "POST", "PUT", "PATCH", "DELETE", "TRACE"} - methods):
                response = client.request(method, path, timeout=CALL_TIMEOUT_S)
                assert response.status_code == 405, (method, path, response.status_code)
                assert set(response.headers["allow"].replace(" ", "").split(",")) == methods, (method, path)
                assert openai_error_problem(response.json(), 405) is None, response.text
