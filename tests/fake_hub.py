"""A Hugging Face Hub on loopback for the tests (the real one cannot be reached from CI): the
few endpoints huggingface_hub's snapshot_download reads (a revision's commit, its file tree, each
file's metadata and bytes), serving one directory as one model repo, and answering other repos
as the Hub does (401 RepoNotFound; 403 GatedRepo for the ids in `gated`; 404 RevisionNotFound
for a revision other than main and the commit). Point huggingface_hub at it with
HF_ENDPOINT=hub.url.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import threading


class FakeHub:
    def __init__(self, repo_id: str, directory: str, gated: tuple[str, ...] = ()):
        self.repo_id, self.directory, self.gated = repo_id, directory, gated
        self.commit = hashlib.sha1(repo_id.encode()).hexdigest()
        self.fetched: list[str] = []  # the files whose bytes were asked for, in order
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _files(self) -> list[str]:
        return sorted(os.listdir(self.directory))

    def _answer(self, h: http.server.BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        for repo in self.gated:
            if f"/{repo}/" in path + "/":
                return _send(h, 403, b"{}", body, {"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"})
        api = f"/api/models/{self.repo_id}/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api + "revision/"):
            if path[len(api + "revision/"):] not in ("main", self.commit):
                return _send(h, 404, b"{}", body, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"})
            info = {"id": self.repo_id, "sha": self.commit, "siblings": [{"rfilename": f} for f in self._files()]}
            return _send(h, 200, json.dumps(info).encode(), body)
        if path.startswith(api + "tree/"):
            tree = [{"type": "file", "path": f, "size": os.path.getsize(os.path.join(self.directory, f)),
                     "oid": hashlib.sha1(f.encode()).hexdigest()} for f in self._files()]
            return _send(h, 200, json.dumps(tree).encode(), body)
        if path.startswith(resolve):
            name = path[len(resolve):].split("/", 1)[1]
            with open(os.path.join(self.directory, name), "rb") as f:
                data = f.read()
            if body:
                self.fetched.append(name)
            return _send(h, 200, data, body, {"ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                              "X-Repo-Commit": self.commit})
        _send(h, 401, b"{}", body, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})


def _send(h, status: int, data: bytes, body: bool, headers: dict | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    if body:
        h.wfile.write(data)
