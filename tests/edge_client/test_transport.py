import grpc

from edge_client.resilience import TRANSIENT
from edge_client.transport import CORE_WRITE_FAILED, VerifyError


def _rpc_error(code, details):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def test_a_write_on_a_stream_core_closed_counts_as_a_lost_link():
    # grpc.aio masks the closed stream's status as this INTERNAL (grpc/grpc#36066); seen when a server shuts down.
    err = VerifyError.from_rpc(_rpc_error(grpc.StatusCode.INTERNAL, CORE_WRITE_FAILED))
    assert err.code == "UNAVAILABLE" and err.code in TRANSIENT
    assert CORE_WRITE_FAILED in err.message


def test_other_refusals_keep_their_code_and_message():
    err = VerifyError.from_rpc(_rpc_error(grpc.StatusCode.INTERNAL, "step failed: boom"))
    assert (err.code, err.message) == ("INTERNAL", "step failed: boom")
    assert err.code not in TRANSIENT
    err = VerifyError.from_rpc(_rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "token id 99999 out of range"))
    assert (err.code, err.message) == ("INVALID_ARGUMENT", "token id 99999 out of range")


def test_unreachable_tells_a_lost_link_from_a_refusal():
    assert VerifyError("UNAVAILABLE", "connection refused").unreachable
    assert VerifyError("DEADLINE_EXCEEDED", "no Opened from the server within 30.0s").unreachable
    assert not VerifyError("RESOURCE_EXHAUSTED", "KV cache full").unreachable
    assert not VerifyError("INVALID_ARGUMENT", "token id 99999 out of range").unreachable
