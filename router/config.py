"""Frozen router configuration: placement policy, latency targets, admission limits. Fields with `metadata`
are `pdserve serve` flags (`pdserve.flags`): their help lives here, next to their default."""
from __future__ import annotations

from dataclasses import dataclass, field

from router.policy import POLICIES

ON_PREFILL_FAILURE = ("retry", "local", "fail")


@dataclass(frozen=True)
class RouterConfig:
    """How the router places and admits requests.

    Args:
        policy: "ratio" (default: cost model against the targets), "always_remote", "always_local",
            "round_robin".
        ttft_target_s: time-to-first-token target the ratio policy plans against, seconds.
        tpot_target_s: time-per-output-token target, seconds.
        max_queued: requests that may wait for a decode worker with room; beyond it requests get
            "overloaded" (HTTP 429 / RESOURCE_EXHAUSTED).
        queue_timeout_s: longest wait for room before "overloaded".
        served_model_name: the model id clients use; None: the model directory's name.
        load_poll_s: how often workers' load (KV blocks, batch) is read for gauges and health.
        hang_timeout_s: a worker that answers no load poll for this long (its process stopped or
            wedged; a busy engine still answers) is killed and replaced; its requests move.
        default_max_tokens: output limit of requests that give none (chat, gRPC), cut to the room left
            in the context.
        on_prefill_failure: when a prefill worker dies or a KV transfer fails before the first token:
            "retry" (another prefill worker; local prefill when none is healthy), "local" (prefill on
            the decode worker), "fail" (the client gets the error).
        max_attempts: most placements of one request before it fails (first one included).
        max_migrations: most times one request moves to another decode worker after one died mid-stream.
        flip_roles: a prefill worker with nothing to prefill serves decode too (whole requests, local
            prefill) until a prompt is worth its prefill back (`router.elastic.RoleFlipper`; ratio
            policy only).
        prefix_aware: place each request by the prefix of its prompt each worker's cache holds, and ship
            a decode worker only the KV it lacks; False: prefix-blind placement, whole prompts shipped
            (a decode worker's cache still serves its local prefills).
    """

    policy: str = field(default="ratio", metadata={"choices": POLICIES, "help": "placement policy"})
    ttft_target_s: float = field(default=2.0, metadata={"flag": "--ttft-target",
                                                        "help": "TTFT target the ratio policy plans for, s"})
    tpot_target_s: float = field(default=0.15, metadata={"flag": "--tpot-target",
                                                         "help": "time-per-output-token target, s"})
    max_queued: int = field(default=256, metadata={"help": "requests that may wait for room before 429"})
    queue_timeout_s: float = field(default=30.0, metadata={"flag": "--queue-timeout",
                                                           "help": "longest wait for room before 429, s"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model id clients use (default: the model directory's name)"})
    load_poll_s: float = 1.0
    hang_timeout_s: float = field(default=30.0, metadata={
        "flag": "--hang-timeout", "help": "a worker that answers no health check for this long is declared hung: "
        "it is killed, replaced, and its requests move to other workers, s"})
    default_max_tokens: int = field(default=1024, metadata={
        "help": "output limit of chat / gRPC requests that set none (cut to the room left in the context)"})
    on_prefill_failure: str = field(default="retry", metadata={
        "choices": ON_PREFILL_FAILURE, "help": "a prefill worker died or a KV transfer failed before the first token: "
        "retry on another prefill worker (local prefill when none is healthy), prefill locally, or fail the request"})
    max_attempts: int = field(default=3, metadata={"help": "most placements of one request before it fails"})
    max_migrations: int = field(default=2, metadata={
        "help": "most moves of one request to another decode worker after one died mid-stream"})
    flip_roles: bool = field(default=False, metadata={
        "help": "a prefill worker with nothing to prefill also serves decode (whole requests) until a prompt "
        "is worth its prefill back (ratio policy)"})
    prefix_aware: bool = field(default=True, metadata={
        "help": "place requests by the prompt prefix each worker's cache holds and ship a decode worker only the "
        "KV it lacks (--no-prefix-aware: prefix-blind placement, whole prompts shipped)"})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("ttft_target_s", "tpot_target_s", "queue_timeout_s", "load_poll_s", "hang_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.flip_roles and self.policy != "ratio":
            raise ValueError(f"flip_roles needs the ratio policy (it prices when a flipped worker is worth "
                             f"its prefill back), got policy {self.policy!r}")
        if self.on_prefill_failure not in ON_PREFILL_FAILURE:
            raise ValueError(f"on_prefill_failure must be one of {', '.join(ON_PREFILL_FAILURE)}; "
                             f"got {self.on_prefill_failure!r}")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if not isinstance(self.max_migrations, int) or self.max_migrations < 0:
            raise ValueError(f"max_migrations must be an integer >= 0, got {self.max_migrations!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be an integer >= 1, got {self.default_max_tokens!r}")
        if not isinstance(self.max_queued, int) or self.max_queued < 0:
            raise ValueError(f"max_queued must be an integer >= 0, got {self.max_queued!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must be a non-empty string or None")
