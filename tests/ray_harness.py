"""A local Ray cluster for tests (``ray.cluster_utils.Cluster`` on loopback): a head without CPUs (it holds
the cluster's state only, and zero-CPU actors such as the session directory), with the system
configuration the Ray executor uses; Ray's worker processes import worldserve and the tests' models by
name, so ``src`` and ``tests`` are on their ``PYTHONPATH`` while it runs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent


@contextlib.contextmanager
def local_cluster() -> Iterator[Any]:
    from ray import cluster_utils

    from worldserve.runtime.executor.ray_actor import LOCAL_SYSTEM_CONFIG

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), str(TESTS), saved or ""])
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,  # nothing here reads it: ~4 s less per cluster on a busy box, and no poller
            "_system_config": dict(LOCAL_SYSTEM_CONFIG),
        },
    )
    try:
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.shutdown()
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
