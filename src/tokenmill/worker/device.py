"""Old home of tokenmill.device, re-exported while the parallel issue-13 branches that import this
path merge; import from tokenmill.device (model code may not import worker)."""

from tokenmill.device import resolve_device, resolve_dtype

__all__ = ["resolve_device", "resolve_dtype"]
