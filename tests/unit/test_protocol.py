"""The router↔worker protocol: every type survives Ray's serializer unchanged; every error kind has
exactly one status, which both API servers give; a worker's stream error is acted on by its kind."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from ray import cloudpickle

from engine.command_loop import Stopped
from kv_transfer import TransferState
from router.grpc_server import error_status
from router.http_server import _error
from router.types import ERROR_STATUS, DeadlineExceeded, RequestFailed
from engine.logprobs import TokenLogprob
from worker_core import protocol
from worker_core.protocol import ErrorKind, LoadReport, PrefillResult, StreamItem, WorkerError, WorkerInfo

INFO = WorkerInfo(worker_id="decode-0-abc123", num_blocks=64, block_size=16, kv_bytes_per_token=46080, num_layers=30,
                  max_num_seqs=32, max_model_len=8192, prefill_chunk_tokens=256, vocab_size=49152, dtype="float32",
                  dtype_reason="the CPU has no bf16 instructions", attention="avx2", compiled=True,
                  linear="packed")


@pytest.mark.parametrize("value", [
    INFO,
    LoadReport(free_blocks=3, num_blocks=64, running=2, receiving=1),
    LoadReport(free_blocks=64, num_blocks=64, queued_tokens=900, sending=2),
    LoadReport(free_blocks=0, num_blocks=64, running=9, threads=2, preemptions=3),
    PrefillResult(first_token=17, prefill_s=0.25, handoff={"refs": [1, 2]}),
    PrefillResult(first_token=17, prefill_s=0.25, first_logprob=TokenLogprob(17, -0.5, (17, 4), (-0.5, -1.25))),
    StreamItem((1, 2, 3), "abc", cached_tokens=16),
    StreamItem((5, 6), "ef", logprobs=(TokenLogprob(5, -0.1), TokenLogprob(6, -2.0, (1,), (-0.3,)))),
    StreamItem((4,), "d", "length", transfer_s=0.01),
    StreamItem.failed(ErrorKind.TRANSFER_FAILED, "KV transfer for r1 failed"),
    TransferState.DONE,
], ids=lambda v: type(v).__name__)
def test_round_trips_through_rays_serializer(value):
    back = cloudpickle.loads(cloudpickle.dumps(value))
    assert back == value and type(back) is type(value)


def test_the_types_are_frozen_and_typed():
    for cls in (WorkerInfo, LoadReport, PrefillResult, StreamItem, WorkerError, TokenLogprob):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    with pytest.raises(dataclasses.FrozenInstanceError):
        INFO.num_blocks = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        WorkerInfo(**{**dataclasses.asdict(INFO), "unknown_field": 1})


def test_stream_items_say_when_they_are_the_last():
    assert not StreamItem((1,), "a").finished
    assert StreamItem((1,), "a", "stop").finished
    last = StreamItem.failed(ErrorKind.WORKER_STOPPING, "decode worker d0 is shutting down")
    assert last.finished and last.finish_reason == "abort" and last.token_ids == ()
    assert last.error == WorkerError(ErrorKind.WORKER_STOPPING, "decode worker d0 is shutting down")


def test_every_error_kind_has_exactly_one_status():
    assert set(ERROR_STATUS) == set(ErrorKind)
    assert len({k.value for k in ErrorKind}) == len(ErrorKind)
    for kind, st in ERROR_STATUS.items():
        assert 400 <= st.http < 600, kind
        assert st.grpc in grpc.StatusCode.__members__ and st.grpc != "OK", kind


@pytest.mark.parametrize("kind", list(ErrorKind), ids=lambda k: k.value)
def test_both_servers_give_a_failed_request_the_status_of_its_kind(kind):
    exc = RequestFailed(f"request r1 failed ({kind.value})", kind)
    status, body, _ = _error(exc, "r1")
    code, message, _ = error_status(exc, "r1")
    want = ERROR_STATUS[kind]
    assert status == want.http and body["error"]["type"] == want.type and body["error"]["code"] == want.code
    assert code == grpc.StatusCode[want.grpc]
    assert message == str(exc) == body["error"]["message"]  # the message is shown, never a trace


def test_a_deadline_is_a_failed_request_of_kind_deadline():
    exc = DeadlineExceeded("its timeout passed")
    assert exc.kind is ErrorKind.DEADLINE
    assert _error(exc, "r1")[0] == 408 and error_status(exc, "r1")[0] == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_protocol_module_imports_neither_torch_nor_ray():
    source = Path(protocol.__file__).read_text()
    assert "import torch" not in source and "import ray" not in source


@pytest.mark.parametrize("kind,got_any,acts", [
    (ErrorKind.TRANSFER_FAILED, False, "retry on prefill"),  # the KV never landed: start it again
    (ErrorKind.TRANSFER_FAILED, True, "fail"),
    (ErrorKind.WORKER_STOPPING, False, "retry on decode"),
    (ErrorKind.WORKER_STOPPING, True, "retry on decode"),  # with tokens sent: a migration
    (ErrorKind.INTERNAL, False, "fail"),
    (ErrorKind.ABORTED, True, "fail"),
])
def test_the_router_acts_on_a_stream_error_by_its_kind_not_its_words(kind, got_any, acts):
    from types import SimpleNamespace

    from router.request import RouterStream, _WorkerFailure

    stream = SimpleNamespace(request_id="r1")
    error = WorkerError(kind, "no words the router could match on")
    with pytest.raises((_WorkerFailure, RequestFailed)) as raised:
        RouterStream._on_error(stream, error, got_any)  # type: ignore[arg-type]
    e = raised.value
    if acts == "fail":
        assert isinstance(e, RequestFailed) and e.kind is kind and error.message in str(e)
    else:
        assert isinstance(e, _WorkerFailure) and e.pool == acts.split()[-1] and e.kind is kind
        assert e.dead == (kind is ErrorKind.WORKER_STOPPING)  # a stopping worker takes no new work


@pytest.mark.parametrize("error,dead,kind", [
    (Stopped("engine-decode-0 has stopped"), True, ErrorKind.WORKER_STOPPING),  # shut down: no more work
    (RuntimeError("no reservation"), False, ErrorKind.PREFILL_FAILED),
])
def test_a_worker_call_that_fails_becomes_a_worker_failure_by_its_type(error, dead, kind):
    import asyncio

    from router.request import _call, _WorkerFailure

    async def failing() -> None:
        raise error
    with pytest.raises(_WorkerFailure) as raised:
        asyncio.run(_call("decode", failing(), ErrorKind.PREFILL_FAILED))
    assert (raised.value.dead, raised.value.kind) == (dead, kind)
