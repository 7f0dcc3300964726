"""`tokenmill plan`: capacity and cost from a model's architecture, a GPU's specs and a roofline
model calibrated by our own benchmark results (docs/PLANNER.md). Torch-free."""
