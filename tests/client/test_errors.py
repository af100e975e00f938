"""errors: gRPC status -> the exception Reverb raises for the operation."""

from __future__ import annotations

import grpc
import pytest

from gear_client.errors import DeadlineExceededError, ReverbError, ServiceError, from_rpc_error


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("operation, expected", [
    ("sample", RuntimeError), ("mutate_priorities", RuntimeError), ("reset", RuntimeError),
    ("insert", ValueError), ("create_item", ValueError),
])
def test_not_found_depends_on_operation(operation, expected):
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.NOT_FOUND, "Table 'nope' not found"), operation)
    assert type(e) is expected
    assert "nope" in str(e)


def test_invalid_argument_is_value_error_with_server_message():
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "priority is NaN"), "insert")
    assert isinstance(e, ValueError) and str(e) == "priority is NaN"


def test_deadline_exceeded():
    e = from_rpc_error(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "rate limiter"), "sample")
    assert isinstance(e, DeadlineExceededError) and isinstance(e, ReverbError)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
def test_service_failures_are_reverb_and_runtime_errors(code):
    e = from_rpc_error(FakeRpcError(code, "server went away"), "sample")
    assert isinstance(e, ServiceError) and isinstance(e, ReverbError) and isinstance(e, RuntimeError)
    assert e.code == code and "server went away" in str(e) and code.name in str(e)


def test_unimplemented():
    assert isinstance(from_rpc_error(FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, "x"), "sample"),
                      NotImplementedError)
