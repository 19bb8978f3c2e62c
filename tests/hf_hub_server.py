"""A minimal Hugging Face Hub API server on 127.0.0.1, for push/download tests that never touch the real Hub.

It implements the subset of the Hub HTTP API that `huggingface_hub` uses to create a repo, upload a
commit (model-card YAML check, preupload, Git LFS batch + basic transfer, ndjson commit) and
resolve/download files, keeping repositories in memory. Point a client at it with `HF_ENDPOINT` (and
`HF_HUB_DISABLE_XET=1`: the Xet storage protocol is not implemented).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"


class HubState:
    """Repositories (`repo_id -> {path: bytes}`), their head commit, uploaded LFS objects, and what the client
    asked for: each repo's visibility and every commit's revision, summary and description."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.heads: dict[str, str] = {}
        self.lfs: dict[str, bytes] = {}
        self.visibility: dict[str, str | None] = {}
        self.commits: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def commit(self, repo_id: str, files: dict[str, bytes], deleted: list[str], summary: str) -> str:
        with self.lock:
            tree = self.repos[repo_id]
            tree.update(files)
            for path in deleted:
                tree.pop(path, None)
            digest = hashlib.sha1(f"{self.heads[repo_id]}:{summary}:{sorted(tree)}".encode()).hexdigest()
            self.heads[repo_id] = digest
            return digest


class _Handler(BaseHTTPRequestHandler):
    state: HubState
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet test output
        pass

    # -- helpers -------------------------------------------------------------------------------
    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, payload: bytes = b"", headers: dict[str, str] | None = None, head: bool = False):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if not head:
            self.wfile.write(payload)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _error(self, status: int, code: str, message: str, head: bool = False) -> None:
        payload = json.dumps({"error": message}).encode()
        self._send(status, payload, {"X-Error-Code": code, "X-Error-Message": message}, head=head)

    def _base(self) -> str:
        return f"http://{self.headers['Host']}"

    # -- routes ---------------------------------------------------------------------------------
    def do_POST(self):
        path = unquote(urlsplit(self.path).path)
        if path == "/api/repos/create":
            body = json.loads(self._body())
            repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
            with self.state.lock:
                if repo_id in self.state.repos:
                    return self._error(409, "RepoExists", f"{repo_id} already exists")
                self.state.repos[repo_id] = {}
                self.state.heads[repo_id] = "0" * 40
                self.state.visibility[repo_id] = body.get("visibility")
            return self._json(200, {"url": f"{self._base()}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":  # README.md metadata check before a commit
            self._body()
            return self._json(200, {"errors": [], "warnings": []})
        if m := re.fullmatch(rf"/api/models/{_REPO}/preupload/[^/]+", path):
            if m["repo"] not in self.state.repos:
                return self._error(404, "RepoNotFound", m["repo"])
            files = json.loads(self._body())["files"]
            modes = [
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                    "shouldIgnore": False,
                }
                for f in files
            ]
            return self._json(200, {"files": modes})
        if m := re.fullmatch(rf"/{_REPO}\.git/info/lfs/objects/batch", path):
            objects = []
            for obj in json.loads(self._body())["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in self.state.lfs:
                    entry["actions"] = {"upload": {"href": f"{self._base()}/lfs-upload/{obj['oid']}"}}
                objects.append(entry)
            return self._json(200, {"transfer": "basic", "objects": objects})
        if m := re.fullmatch(rf"/api/models/{_REPO}/commit/(?P<revision>[^/]+)", path):
            return self._commit(m["repo"], m["revision"])
        return self._error(404, "NotFound", path)

    def do_PUT(self):
        path = unquote(urlsplit(self.path).path)
        if m := re.fullmatch(r"/lfs-upload/(?P<oid>[0-9a-f]{64})", path):
            data = self._body()
            if hashlib.sha256(data).hexdigest() != m["oid"]:
                return self._error(400, "BadOid", "content does not match its oid")
            self.state.lfs[m["oid"]] = data
            return self._send(200)
        return self._error(404, "NotFound", path)

    def _commit(self, repo_id: str, revision: str) -> None:
        if repo_id not in self.state.repos:
            return self._error(404, "RepoNotFound", repo_id)
        files, deleted, summary = {}, [], ""
        for line in self._body().decode().splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value.get("summary", "")
                self.state.commits.append(
                    {
                        "repo_id": repo_id,
                        "revision": revision,
                        "summary": summary,
                        "description": value.get("description", ""),
                    }
                )
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.state.lfs:
                    return self._error(422, "LfsObjectMissing", f"{value['path']}: LFS object not uploaded")
                files[value["path"]] = self.state.lfs[value["oid"]]
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
        oid = self.state.commit(repo_id, files, deleted, summary)
        return self._json(200, {"commitUrl": f"{self._base()}/{repo_id}/commit/{oid}", "commitOid": oid})

    def _resolve(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        m = re.fullmatch(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        if m is None:
            return self._error(404, "NotFound", path, head=head)
        repo_id = m["repo"]
        if repo_id not in self.state.repos:
            return self._error(404, "RepoNotFound", repo_id, head=head)
        if m["rev"] not in ("main", self.state.heads[repo_id]):
            return self._error(404, "RevisionNotFound", m["rev"], head=head)
        data = self.state.repos[repo_id].get(m["file"])
        if data is None:
            return self._error(404, "EntryNotFound", m["file"], head=head)
        headers = {
            "X-Repo-Commit": self.state.heads[repo_id],
            "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
            "Content-Type": "application/octet-stream",
        }
        return self._send(200, data, headers, head=head)

    def do_HEAD(self):
        self._resolve(head=True)

    def do_GET(self):
        self._resolve(head=False)


class LocalHub:
    """Runs the server in a background thread; `endpoint` is its base URL."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
