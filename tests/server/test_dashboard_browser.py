"""/dashboard in a real headless browser (Debian's chromium driven by Playwright): against a server
on a real port (the fake engine behind the real API server) under load, the page draws its charts,
its totals equal /metrics once the load stops, a slow request's timeline opens on click, and a
screenshot is saved (under the test's tmp dir; TOKENMILL_UPDATE_DASHBOARD_SCREENSHOT=1 also writes
docs/dashboard.png)."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from tests.server.fake_engine import MODEL, FakeEngine, fake_server_state
from tests.server.server_process import free_port
from tokenmill.dashboard import MetricsHistory, registry_source
from tokenmill.server.api_server import create_app

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]  # fmt: skip
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"

sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
if not os.path.exists(CHROMIUM):
    pytest.skip(f"no {CHROMIUM} (scripts/setup.sh installs Debian's chromium with apt)", allow_module_level=True)


class LiveServer:
    """The API server over the fake engine, served by uvicorn on a free loopback port in a thread."""

    def __init__(self) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        engine = FakeEngine(step_s=0.004)
        await engine.start()
        state = fake_server_state(engine, cost_per_hour=2.0)
        # Short intervals: a test of seconds still gets many points.
        state.dashboard = MetricsHistory(
            registry_source(state.metrics.registry), state.metrics.prefix, interval_s=0.2, window_s=1.0, cost_per_hour=2.0
        )
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.started.set()
        try:
            await self.server.serve()
        finally:
            await engine.shutdown()

    def __enter__(self) -> LiveServer:
        self.thread.start()
        assert self.started.wait(10)
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.should_exit = True
        self.thread.join(15)


def put_load(base_url: str, seconds: float) -> int:
    """Concurrent completions (streamed and not) for `seconds`; returns how many were sent."""

    async def main() -> int:
        sent = 0
        deadline = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:

            async def worker(w: int) -> None:
                nonlocal sent
                i = 0
                while time.monotonic() < deadline:
                    body = {"model": MODEL, "prompt": "y" * (4 + i % 9), "max_tokens": 2 + (i * 7 + w) % 30,
                            "ignore_eos": True, "stream": bool(i % 2)}  # fmt: skip
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    sent += 1
                    i += 1

            await asyncio.gather(*(worker(w) for w in range(6)))
        return sent

    return asyncio.run(main())


def metric_sums(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base_url + "/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_dashboard_renders_under_load_and_matches_metrics(tmp_path) -> None:
    with LiveServer() as live, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(live.base_url + "/dashboard")
            # Playwright's sync API runs an event loop on this thread: the load gets its own.
            with ThreadPoolExecutor(1) as pool:
                loading = pool.submit(put_load, live.base_url, 3.0)
                while not loading.done():
                    page.wait_for_timeout(100)
                sent = loading.result()
            assert sent > 20
            exported = metric_sums(live.base_url)  # the load is over: these numbers no longer move
            for element, metric in (
                ("total-requests_finished", "tokenmill:request_success_total"),
                ("total-output_tokens", "tokenmill:generation_tokens_total"),
                ("total-prompt_tokens", "tokenmill:prompt_tokens_total"),
            ):
                page.wait_for_function(
                    f"document.getElementById('{element}').dataset.value === '{exported[metric]:g}'", timeout=5000
                )
            assert exported["tokenmill:request_success_total"] == sent
            # Every chart drew: a canvas with line pixels in it, and a legend.
            assert page.locator(".chart canvas").count() == 12
            drawn = page.evaluate(
                """() => [...document.querySelectorAll('.chart canvas')].map((c) => {
                       const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                       let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })"""
            )
            assert all(n > 100 for n in drawn), drawn
            for series in ("ttft-p50", "ttft-p99", "throughput-output", "tpot-p50"):
                latest = page.locator(f'[data-series="{series}"]').inner_text()
                assert latest != "–", (series, latest)
            assert page.locator("#total-cost_overall").inner_text().startswith("$")
            assert page.locator("#total-rejections").inner_text() == "0"  # the page asks for nothing missing
            # The slowest requests, and one's timeline on click.
            rows = page.locator("#slowest tbody tr")
            assert rows.count() == 20
            rows.first.click()
            page.wait_for_selector("#timeline-svg rect.phase")
            phases = page.eval_on_selector_all("#timeline-svg rect.phase", "els => els.map(e => e.dataset.phase)")
            assert phases == ["to engine", "waiting", "prefill", "decode", "to client"]
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
            if os.environ.get("TOKENMILL_UPDATE_DASHBOARD_SCREENSHOT") == "1":
                shutil.copyfile(shot, DOCS_SCREENSHOT)
            assert errors == []
        finally:
            browser.close()
