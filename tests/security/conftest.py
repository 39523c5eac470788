"""Shared by the security tests: clusters on helper `sec`'s ports (10000-10999).

Each cluster takes base+1..3 (Raft), base+101..103 (clients), base+201..203 (data plane), so
bases 10000, 10010, ... 10090 never collide.
"""
import pytest

from security_helpers import start


@pytest.fixture(scope="module")
def module_cluster(request, tmp_path_factory):
    """One 3-node cluster per module, at the module's BASE."""
    cluster = start(tmp_path_factory.mktemp("sec"), request.module.BASE)
    yield cluster
    cluster.wipe()
