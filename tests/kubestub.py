"""A stub of the Kubernetes API's discovery endpoints on loopback, for `kubectl create
--dry-run=client`: kubectl maps each document's kind to a resource through discovery before it
builds the object, even with a client-side dry run. Nothing but discovery is served."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_GROUPS = {"batch": ["v1"]}
_RESOURCES = {
    "/api/v1": [("configmaps", "ConfigMap", True), ("pods", "Pod", True)],
    "/apis/batch/v1": [("jobs", "Job", True), ("cronjobs", "CronJob", True)],
}


def _documents() -> dict[str, object]:
    docs: dict[str, object] = {
        "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
        "/apis": {
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": [
                {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
                 "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
                for g, vs in _GROUPS.items()
            ],
        },
        "/version": {"major": "1", "minor": "32", "gitVersion": "v1.32.0"},
    }  # fmt: skip
    for path, resources in _RESOURCES.items():
        docs[path] = {
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": path.removeprefix("/apis/").removeprefix("/api/") if path.startswith("/apis/") else "v1",
            "resources": [
                {"name": n, "singularName": "", "namespaced": ns, "kind": k, "verbs": ["create", "get", "list"]}
                for n, k, ns in resources
            ],
        }
    return docs


class _Handler(BaseHTTPRequestHandler):
    docs = _documents()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        doc = self.docs.get(self.path.split("?")[0])
        body = json.dumps(doc if doc is not None else {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if doc is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def kubeconfig(tmp: Path) -> Iterator[Path]:
    """A kubeconfig that points kubectl at the stub, served while the block runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = tmp / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: stub\n"
        f"clusters: [{{name: stub, cluster: {{server: 'http://127.0.0.1:{server.server_port}'}}}}]\n"
        "contexts: [{name: stub, context: {cluster: stub, user: stub, namespace: default}}]\n"
        "users: [{name: stub, user: {}}]\n"
    )
    try:
        yield config
    finally:
        server.shutdown()
        server.server_close()
