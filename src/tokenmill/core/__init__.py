"""Pure-Python scheduling core: requests, the block pool, the KV cache manager, the scheduler.

Nothing here imports torch, so all of it is unit-tested with no model.
"""
