"""WorkerLifecycle: reset/close through one collective RPC, succeeding only when every worker supports it."""

from __future__ import annotations

from typing import Any

import pytest

from worldserve import CLOSE_SESSION_RPC, RESET_SESSION_RPC, SessionError, WorkerLifecycle


class RPCClient:
    def __init__(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result = [[True]] if result is None else result
        self.error = error
        self.calls: list[dict[str, Any]] = []

    async def collective_rpc(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error
        return self.result


async def test_reset_and_close_call_the_selected_stages() -> None:
    client = RPCClient()
    stages = [3, 1]
    lifecycle = WorkerLifecycle(client, stage_ids=stages, timeout=2.5)
    stages.append(9)  # the lifecycle keeps its own copy
    await lifecycle.reset_session("world-1")
    await lifecycle.close_session("world-2")
    assert client.calls == [
        {"method": "reset_ar_diffusion_session", "timeout": 2.5, "args": ("world-1",), "stage_ids": [3, 1]},
        {"method": "close_ar_diffusion_session", "timeout": 2.5, "args": ("world-2",), "stage_ids": [3, 1]},
    ]
    assert (RESET_SESSION_RPC, CLOSE_SESSION_RPC) == ("reset_ar_diffusion_session", "close_ar_diffusion_session")
    client.calls[0]["stage_ids"].append(7)  # each call gets a fresh list
    await lifecycle.close_session("world-1")
    assert client.calls[-1]["stage_ids"] == [3, 1]


async def test_timeout_defaults_to_none() -> None:
    client = RPCClient()
    await WorkerLifecycle(client, stage_ids=(0,)).close_session("s")
    assert client.calls[0]["timeout"] is None


@pytest.mark.parametrize(
    "result",
    [
        [True],
        [[True]],
        [True, (True, [True])],
        [{"supported": True, "result": True}],
        [{"result": [True, {"result": (True,)}]}],
        ({"result": True}, [True]),
    ],
)
async def test_every_selected_worker_supporting_succeeds(result: Any) -> None:
    await WorkerLifecycle(RPCClient(result), stage_ids=[0]).reset_session("s")


@pytest.mark.parametrize(
    "result",
    [
        [],
        [[]],
        [False],
        [True, False],
        [[True], [False]],
        [{"supported": True}],  # a mapping without a result reports nothing
        [{"result": None}],
        ["ok"],
        [1],
        None,
        {"result": False},
    ],
)
async def test_missing_or_partial_support_fails(result: Any) -> None:
    client = RPCClient(result)
    client.result = result
    lifecycle = WorkerLifecycle(client, stage_ids=[0])
    with pytest.raises(SessionError, match=r"^close_ar_diffusion_session is not supported by every selected worker"):
        await lifecycle.close_session("s")
    with pytest.raises(SessionError, match=r"^reset_ar_diffusion_session is not supported by every selected worker"):
        await lifecycle.reset_session("s")


async def test_workers_reasons_are_reported() -> None:
    lifecycle = WorkerLifecycle(
        RPCClient(
            [
                {"supported": False, "error": "stage 1 is not an AR stage"},
                [True, {"result": [{"supported": False, "error": "no such session"}]}],
                {"supported": False},
            ]
        ),
        stage_ids=[1, 2],
    )
    with pytest.raises(SessionError) as caught:
        await lifecycle.close_session("s")
    assert str(caught.value) == (
        "close_ar_diffusion_session failed: stage 1 is not an AR stage; no such session; "
        "target stage does not support this lifecycle RPC"
    )
    assert caught.value.code == "session_error"


async def test_rpc_errors_propagate_unchanged() -> None:
    error = TimeoutError("rpc timed out")
    with pytest.raises(TimeoutError) as caught:
        await WorkerLifecycle(RPCClient(error=error), stage_ids=[0]).reset_session("s")
    assert caught.value is error


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage_ids": []}, "stage_ids must select at least one AR-Diffusion stage"),
        ({"stage_ids": [-1]}, "stage_ids must contain non-negative integers"),
        ({"stage_ids": [0, True]}, "stage_ids must contain non-negative integers"),
        ({"stage_ids": ["0"]}, "stage_ids must contain non-negative integers"),
        ({"stage_ids": [0], "timeout": 0}, "timeout must be positive or None"),
        ({"stage_ids": [0], "timeout": -1.0}, "timeout must be positive or None"),
    ],
)
def test_construction_is_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerLifecycle(RPCClient(), **kwargs)


async def test_stage_ids_may_be_any_iterable_of_ints() -> None:
    client = RPCClient()
    await WorkerLifecycle(client, stage_ids=range(2)).reset_session("s")
    await WorkerLifecycle(client, stage_ids=(x for x in (4,))).reset_session("s")  # type: ignore[arg-type]
    assert [call["stage_ids"] for call in client.calls] == [[0, 1], [4]]
