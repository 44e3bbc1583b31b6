"""What one request's run left behind: timings, token counts, error. Plain data, JSON round-trippable."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Error kinds (RequestRecord.error_kind). HTTP statuses are "http_<status>", gRPC codes "grpc_<code name>".
BAD_JSON = "bad_json"              # an SSE event that is not valid JSON
BAD_RESPONSE = "bad_response"      # valid JSON, wrong shape (missing or mistyped fields)
SERVER_ERROR = "server_error"      # the server reported an error in-band (an SSE `error` event)
CONNECTION = "connection"          # connection refused, reset or dropped mid-stream
TIMEOUT = "timeout"                # the per-request timeout expired
INCOMPLETE = "incomplete"          # the stream ended without a finish reason
ABORTED = "aborted"                # the server finished the request with finish_reason "abort"
CANCELLED = "cancelled"            # the run's max duration ended while the request was in flight
CLIENT_EXCEPTION = "client_exception"  # anything else raised while handling the response

PHASES = ("queue_s", "prefill_s", "transfer_s", "decode_s")
TIMING_KEYS = PHASES + ("ttft_s", "e2e_s")


@dataclass
class RequestRecord:
    """One request as the client saw it. All times in seconds.

    index: the request's position in the workload. start_s: when it was sent, from the run's start.
    scheduled_s: when the schedule wanted it sent (open loop; equals start_s in closed loop).
    ttft_s: send to the first chunk carrying output. chunk_times_s: arrival of every chunk carrying output,
    from the send (the first equals ttft_s). e2e_s: send to the end of the stream.
    output_tokens: usage.completion_tokens when the server gave it, else the number of output chunks
    (output_tokens_source says which). error / error_kind: None when the request succeeded.
    timings: pdserve's phase timings (path, queue_s, prefill_s, transfer_s, decode_s, ttft_s, e2e_s) if sent.
    cached_tokens: prompt tokens the server served from its prefix cache (`usage.prompt_tokens_details`), if
    it says. conversation / turn: in a multi-turn workload, the request's conversation and its turn there
    (0: the first); conversation None otherwise. output_text / output_token_ids: what the server answered,
    kept only when the spec asked (`RequestSpec.keep_output`; the ids when the server sends them), else None.
    """

    index: int
    prompt_tokens: int
    requested_output_tokens: int
    start_s: float = 0.0
    scheduled_s: float = 0.0
    ttft_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    output_tokens: int = 0
    output_tokens_source: str = "chunks"
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    conversation: int | None = None
    turn: int = 0
    finish_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None
    timings: dict[str, Any] | None = None
    output_text: str | None = None
    output_token_ids: list[int] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def fail(self, kind: str, message: str) -> RequestRecord:
        """Marks the request failed (the first failure wins). Returns: self."""
        if self.error is None:
            self.error_kind, self.error = kind, message[:500]
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def parse_timings(obj: Any) -> dict[str, Any] | None:
    """Args: the server's `pdserve_timings` object (any JSON value). Returns: the known, well-typed fields
    (path and worker names as strings, durations as floats), or None when obj is not an object."""
    if not isinstance(obj, dict):
        return None
    out: dict[str, Any] = {}
    for key in ("path", "prefill_worker", "decode_worker"):
        if isinstance(obj.get(key), str):
            out[key] = obj[key]
    for key in TIMING_KEYS:
        value = obj.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    return out
