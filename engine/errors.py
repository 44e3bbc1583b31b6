"""User-facing errors of the engine. Each message names the field and what is allowed."""


class InvalidRequestError(ValueError):
    """A request the engine cannot run as given (bad prompt or sampling field)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class CapacityError(RuntimeError):
    """No room right now (KV blocks or sequence slots); try another worker or later."""


class SamplingError(RuntimeError):
    """No token could be picked for one request (its adjusted logits hold no finite value, or its grammar
    refused the pick): that request fails, the others of its step go on."""
