import pytest

from tests.integration.golden import run_golden


@pytest.fixture(scope="session")
def golden_run(tmp_path_factory, train_data):
    """The golden run (tests/integration/golden.py), shared by every test that only reads it."""
    run_dir = tmp_path_factory.mktemp("golden")
    run_golden(run_dir, train_data)
    return run_dir
