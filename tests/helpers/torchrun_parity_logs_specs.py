"""A ``torchrun.logs_specs`` plugin for tests/e2e/test_torchrun_parity.py.

torch's default layout, but in ``<log_dir>/fixed`` instead of a randomly named run
directory, so that the files torchrun and rallypoint run write can be compared.
The test registers it through a ``*.dist-info/entry_points.txt`` on PYTHONPATH.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs


class FixedLogsSpecs(DefaultLogsSpecs):
    def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
        path = os.path.join(log_dir or ".", "fixed")
        os.makedirs(path, exist_ok=True)
        return path
