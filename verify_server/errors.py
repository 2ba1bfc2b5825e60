"""Domain errors that carry the gRPC status code they become at the wire."""


class SledError(Exception):
    """A refusal with a status code name from grpc.StatusCode and a clear message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> SledError:
    return SledError("INVALID_ARGUMENT", message)


def exhausted(message: str) -> SledError:
    return SledError("RESOURCE_EXHAUSTED", message)
