"""Executors: how the engine reaches its workers (in-process threads, spawned processes)."""

from __future__ import annotations

from worldserve.runtime.executor.abstract import DeathCallback, Executor
from worldserve.runtime.executor.inproc import InprocExecutor
from worldserve.runtime.executor.multiproc import MultiprocExecutor

__all__ = ["DeathCallback", "Executor", "InprocExecutor", "MultiprocExecutor"]
