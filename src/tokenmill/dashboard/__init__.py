"""The live dashboard (`/dashboard`): a static page fed by a JSON endpoint, torch-free.

Reusable by anything that has Prometheus metrics: `MetricsHistory` samples a metrics source (a
callable returning metric families: a `CollectorRegistry`'s collect, or parsed /metrics text) and
keeps windowed percentiles and rates; `RecentRequests` keeps the recent finished requests'
timelines; `dashboard_router` serves both.
"""

from tokenmill.dashboard.history import MetricsHistory
from tokenmill.dashboard.recent_requests import FinishedRequest, RecentRequests
from tokenmill.dashboard.routes import dashboard_router
from tokenmill.dashboard.snapshot import registry_source, text_source

__all__ = [
    "FinishedRequest",
    "MetricsHistory",
    "RecentRequests",
    "dashboard_router",
    "registry_source",
    "text_source",
]
