"""store/s3/dataplane.py: the data plane's connection pool honours the proxy variables as botocore does."""

from __future__ import annotations

import urllib3

from neffbuild.store.s3.dataplane import http_pool


def test_the_pool_goes_through_a_proxy_unless_the_host_is_exempt() -> None:
    endpoint = "http://store.internal:9000"
    assert type(http_pool(endpoint, {})) is urllib3.PoolManager
    proxied = http_pool(endpoint, {"HTTP_PROXY": "http://proxy.internal:3128"})
    assert isinstance(proxied, urllib3.ProxyManager) and proxied.proxy is not None
    assert proxied.proxy.host == "proxy.internal"
    exempt = {"http_proxy": "http://proxy.internal:3128", "no_proxy": "store.internal"}
    assert type(http_pool(endpoint, exempt)) is urllib3.PoolManager
    assert (
        type(http_pool(endpoint, {"HTTPS_PROXY": "http://proxy.internal:3128"})) is urllib3.PoolManager
    )  # http endpoint
