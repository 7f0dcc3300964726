"""Executors: how the engine core runs a step on its model runner(s). See abstract.py."""

from tokenmill.engine.executor.abstract import Executor, PendingOutput

__all__ = ["Executor", "PendingOutput"]
