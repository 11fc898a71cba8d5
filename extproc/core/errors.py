"""The one exception the routing core raises for unusable input."""


class InvalidRequest(ValueError):
    """The request body cannot be routed by prefix: not a JSON object, wrong types, bad UTF-8,
    absurd nesting.

    Callers route such requests fail-open (least loaded) or answer 4xx; nothing else escapes
    the core for bad input.
    """
