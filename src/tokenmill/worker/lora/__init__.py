"""Multi-LoRA in the worker: adapters' weights in host memory and device slots, the per-step
token -> slot mapping, and the linear method that adds each token's adapter product."""
