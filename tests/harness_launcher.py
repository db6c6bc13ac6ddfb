"""`python tests/harness_launcher.py N SPEC.json`: N local workers running tests/distributed_harness.py's
`main(SPEC.json)`, started by PyTorch's elastic launcher (what torchrun runs: a private c10d rendezvous, as
`--standalone`) and forked from one server process that imported the harness and the trainer once, as
`python -m trainer` forks its workers (trainer.launch.worker_start_method).

torchrun starts each worker as a new interpreter that imports torch and the trainer again: 4.5 s of CPU per
worker on the 2-core test machine, 8 x 4.5 s for the 8-process launch, while this launcher imports only torch's
launcher and the server imports the rest once. This file imports nothing of the trainer itself, so that the
two imports do not run one after the other.
"""

from __future__ import annotations

import multiprocessing
import sys
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HARNESS_MODULE = "tests.distributed_harness"


def worker(spec: str) -> None:
    """One worker: the harness's runs (its module is already imported in the server it forked from)."""
    from tests.distributed_harness import main

    main(spec)


def launch(nproc: int, spec: str) -> None:
    from tests.harness_launcher import worker as by_name  # pickled by its module's name, not as __main__'s

    multiprocessing.set_forkserver_preload([HARNESS_MODULE])
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          start_method="forkserver")
    elastic_launch(config, by_name)(spec)


if __name__ == "__main__":
    launch(int(sys.argv[1]), sys.argv[2])
