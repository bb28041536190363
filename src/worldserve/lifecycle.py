"""Reset and close reach the model workers through one collective RPC.

Owns: :class:`WorkerLifecycle`, the :class:`~worldserve.session.SessionLifecycle`
that calls ``collective_rpc("reset_ar_diffusion_session" | "close_ar_diffusion_session")``
on selected stages and succeeds only when every selected worker reports support.

Must not know: how the RPC travels (an engine, vllm-omni's orchestrator, a test fake).
Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from worldserve.session import SessionError

__all__ = ["CLOSE_SESSION_RPC", "RESET_SESSION_RPC", "CollectiveRPCClient", "WorkerLifecycle"]

RESET_SESSION_RPC = "reset_ar_diffusion_session"
CLOSE_SESSION_RPC = "close_ar_diffusion_session"


class CollectiveRPCClient(Protocol):
    """The part of an engine's control RPC surface the lifecycle uses."""

    async def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        stage_ids: list[int] | None = None,
    ) -> list[Any]: ...


def _collect(value: Any, errors: list[str], supported: list[bool]) -> None:
    """Walk nested results: bools, lists/tuples of them, or ``{supported, error, result}`` mappings."""
    if isinstance(value, bool):
        supported.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, errors, supported)
    elif isinstance(value, Mapping):
        if value.get("supported") is False:
            errors.append(str(value.get("error") or "target stage does not support this lifecycle RPC"))
        elif "result" in value:
            _collect(value["result"], errors, supported)


class WorkerLifecycle:
    """Routes reset/close of a session to the selected stages' workers."""

    def __init__(
        self,
        rpc_client: CollectiveRPCClient,
        *,
        stage_ids: Sequence[int],
        timeout: float | None = None,
    ) -> None:
        stages = tuple(stage_ids)
        if not stages:
            raise ValueError("stage_ids must select at least one AR-Diffusion stage.")
        if any(isinstance(stage, bool) or not isinstance(stage, int) or stage < 0 for stage in stages):
            raise ValueError("stage_ids must contain non-negative integers.")
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be positive or None.")
        self._rpc_client = rpc_client
        self._stage_ids = stages
        self._timeout = timeout

    async def _invoke(self, method: str, session_id: str) -> None:
        results = await self._rpc_client.collective_rpc(
            method=method,
            timeout=self._timeout,
            args=(session_id,),
            stage_ids=list(self._stage_ids),
        )
        errors: list[str] = []
        supported: list[bool] = []
        _collect(results, errors, supported)
        if errors:
            raise SessionError(f"{method} failed: {'; '.join(errors)}")
        if not supported or not all(supported):
            raise SessionError(f"{method} is not supported by every selected worker.")

    async def reset_session(self, session_id: str) -> None:
        await self._invoke(RESET_SESSION_RPC, session_id)

    async def close_session(self, session_id: str) -> None:
        await self._invoke(CLOSE_SESSION_RPC, session_id)
