from pathlib import Path

import pytest

from tests.conftest import built_once
from tests.integration.golden import run_golden
from tests.integration.s3_server import s3_server  # noqa: F401  (a fixture)
from tests.integration.slurm_cluster import slurm  # noqa: F401  (a fixture)
from tests.integration.ssh_hosts import ssh_hosts  # noqa: F401  (a fixture)


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory, train_data):
    """The golden run (tests/integration/golden.py), shared by every test that only reads it."""
    return built_once(tmp_path_factory, "golden", lambda run_dir: run_golden(run_dir, train_data))


def pytest_collection_modifyitems(config, items):
    """Everything in this tier is `slow` (real processes): `-m "not slow"` is the unit tier."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
