import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def dcp_ckpts(tmp_path_factory):
    """Real DCP checkpoints in three layouts, written once per session by torch (tests/dcp_fixtures.py)."""
    from dcp_fixtures import make_dcp_checkpoints

    return make_dcp_checkpoints(tmp_path_factory.mktemp("dcp"))
