"""The role split: how many prefill workers hold the prefill role, and whether an operator pinned it.

Lifecycle of a pinned split (`POST /pdserve/split`, `pdserve plan --watch --apply`):
1. A client sends `{"prefill": N}`: N of the server's prefill workers keep the prefill role, the
   others serve decode through their flex slots (`router.elastic.RoleFlipper`); `{"prefill": null}`
   (or `DELETE /pdserve/split`) returns to automatic flips. `parse_split_body` checks the body
   (not an object, an unknown field, a wrong type: `InvalidRequestError` naming it, a 400).
2. On the router's event loop, `RoleSplit.check` refuses what the server cannot apply: a server
   that does not flip roles (`SplitUnavailable`, a 409 saying to start it with `--flip-roles`), or
   N over its prefill workers (a 400 naming `prefill`: a decode worker cannot take the prefill
   role). The placer then pins its `RoleFlipper`; nothing in flight moves.
3. The answer, and `GET /pdserve/split`, is the `RoleSplit` now (`to_json`); `pdserve plan --watch`
   reads it back with `RoleSplit.from_json` and runs the same `check` before it asks.

Boundary rule: never imports Ray, no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from engine.errors import InvalidRequestError


class Mechanism(str, Enum):
    """What moves compute between roles on a server: role flips (a split can be pinned), threads lent
    between a node's workers (no role changes), or nothing."""

    FLIP_ROLES = "flip_roles"
    LEND_THREADS = "lend_threads"
    NONE = "none"


class SplitUnavailable(RuntimeError):
    """The server runs no mechanism that can hold a role split (HTTP 409)."""


_WHY_NOT = {
    Mechanism.LEND_THREADS: "this server lends threads between a node's prefill and decode worker, which moves no "
                            "role",
    Mechanism.NONE: "this server moves no compute between roles",
}


@dataclass(frozen=True)
class RoleSplit:
    """Args: prefill_workers / decode_workers: the server's workers; prefill_role: prefill workers holding
    the prefill role now (the others are flipped to decode); pinned: the prefill role count an operator
    holds, None while flips are automatic; mechanism."""

    prefill_workers: int
    decode_workers: int
    prefill_role: int
    pinned: int | None
    mechanism: Mechanism

    @property
    def flipped(self) -> int:
        """Prefill workers serving decode now."""
        return self.prefill_workers - self.prefill_role

    def require_flips(self) -> None:
        """Raise SplitUnavailable (saying how to start the server so) unless it flips roles."""
        if self.mechanism is not Mechanism.FLIP_ROLES:
            raise SplitUnavailable(f"{_WHY_NOT[self.mechanism]}: start it with --flip-roles (and the ratio policy) "
                                   "to set its role split")

    def check(self, prefill: int) -> None:
        """Raise unless this server can hold `prefill` prefill workers in the prefill role.

        Raises: SplitUnavailable (no role flips); InvalidRequestError naming `prefill` (out of range;
        more than the server has: a decode worker cannot take the prefill role)."""
        self.require_flips()
        if prefill < 0:
            raise InvalidRequestError("prefill", f"must be >= 0 prefill workers, got {prefill}")
        if prefill > self.prefill_workers:
            raise InvalidRequestError("prefill", f"this server has {self.prefill_workers} prefill workers, so at "
                                      f"most {self.prefill_workers} hold the prefill role, got {prefill}; a decode "
                                      f"worker cannot take the prefill role: for {prefill}, start the server with "
                                      f"--prefill {prefill} or more")

    def describe(self) -> str:
        """One line, e.g. "1 of 2 prefill workers prefill, 1 flipped to decode, beside 2 decode workers (pinned)"."""
        mode = {Mechanism.FLIP_ROLES: "pinned" if self.pinned is not None else "automatic flips",
                Mechanism.LEND_THREADS: "fixed; threads lent", Mechanism.NONE: "fixed"}[self.mechanism]
        return (f"{self.prefill_role} of {self.prefill_workers} prefill workers prefill, {self.flipped} flipped to "
                f"decode, beside {self.decode_workers} decode workers ({mode})")

    def to_json(self) -> dict:
        return {**asdict(self), "mechanism": self.mechanism.value}

    @classmethod
    def from_json(cls, data: object) -> RoleSplit:
        """Raises ValueError naming what is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a role split must be a JSON object, got {type(data).__name__}")  # noqa: TRY004
        try:
            counts = {name: data[name] for name in ("prefill_workers", "decode_workers", "prefill_role")}
            pinned, mechanism = data["pinned"], Mechanism(data["mechanism"])
        except KeyError as e:
            raise ValueError(f"a role split lacks the field {e.args[0]!r}") from None
        bad = [n for n, v in {**counts, "pinned": pinned}.items()
               if not (isinstance(v, int) and not isinstance(v, bool)) and not (n == "pinned" and v is None)]
        if bad:
            raise ValueError(f"a role split's {', '.join(bad)} must be integers")
        return cls(counts["prefill_workers"], counts["decode_workers"], counts["prefill_role"], pinned, mechanism)


def parse_split_body(body: object) -> int | None:
    """The prefill role count a `POST /pdserve/split` body asks for; None: automatic flips again.
    Raises InvalidRequestError naming the field (`body`, an unknown one, `prefill`)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", 'must be a JSON object such as {"prefill": 1}')
    unknown = sorted(set(body) - {"prefill"})
    if unknown:
        raise InvalidRequestError(unknown[0], "is not a field of a role split; its one field is prefill (the prefill "
                                  "workers that hold the prefill role, or null for automatic flips)")
    if "prefill" not in body:
        raise InvalidRequestError("prefill", "is required: the prefill workers that hold the prefill role, or null "
                                  "for automatic flips")
    value = body["prefill"]
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError("prefill", f"must be an integer (prefill workers) or null, got "
                                  f"{type(value).__name__}")
    return value  # its range is the server's: `RoleSplit.check`
