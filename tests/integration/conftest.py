"""Fixtures the integration tests share: one local Ray cluster for the whole run, with both pools'
resources, and tiny random models saved where workers can load them."""
from __future__ import annotations

import gc

import pytest
import ray
from transformers import PreTrainedModel

from router.pools import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.conftest import tiny_model


@pytest.fixture(scope="session")
def ray_cluster() -> None:
    """A local Ray for the test run: 2 CPUs and room for 4 workers per pool (workers claim no CPU:
    `num_cpus=0`). Each module's fixtures shut down the workers they start. One cluster for the run,
    not one per module: a driver that connects and shuts down again and again is where Ray's client
    library crashed the test process (a segfault after a module's shutdown, now and then)."""
    ray.init(num_cpus=2, resources={PREFILL_RESOURCE: 4, DECODE_RESOURCE: 4}, include_dashboard=False,
             log_to_driver=False)
    yield
    # Routers, streams and tasks of the module's tests can sit in reference cycles that hold object
    # refs and actor handles; freed after `ray.shutdown` their destructors would call into a core
    # worker that is gone. Free them while Ray is up.
    gc.collect()
    ray.shutdown()


def saved_tiny_model(tmp_path_factory: pytest.TempPathFactory, arch: str, seed: int) -> tuple[PreTrainedModel, str]:
    """A tiny random model (the oracle) and the directory it is saved in (what workers load)."""
    ref = tiny_model(arch, seed=seed)
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    ref.save_pretrained(path)
    return ref, str(path)
