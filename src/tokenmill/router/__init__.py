"""The cache-aware router (`tokenmill router`) and the dispatch policy it shares with data parallelism.

Torch-free and free of the engine: `prefix_index`, `policy` and `balancer` are plain Python that
`engine/dp_client.py` reuses to spread requests over several engine cores; the HTTP parts
(`app`, `proxy`, `replicas`, `launch`) need only FastAPI, httpx and prometheus-client.
"""
