"""Load generator for LLM servers: pdserve's gRPC API or any OpenAI-compatible HTTP server.

A client of the server only: it never imports `router`, `engine` or Ray.

Modules: `workload` (what to send), `clients` / `openai_client` / `grpc_client` (stream one request and time
it), `runner` (open loop, closed loop, rate sweeps), `metrics` (summaries, goodput), `report` (JSON, text),
`plots` (PNG charts), `cli` (`python -m loadtest`, also `pdserve bench serve`).
"""
