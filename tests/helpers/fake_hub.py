"""A stand-in for the Hugging Face Hub on 127.0.0.1: the endpoints huggingface_hub calls to list a repository and
download its files (the tree API, model info, and resolve with its headers and byte ranges), over repositories the
tests make. Point huggingface_hub at it with HF_ENDPOINT (see the hub fixture in tests/units/test_hub.py).

A repository may be gated (refused without an Authorization header); a file is sent from the byte a Range header
asks for, and may be cut off after some bytes the first time it is sent (a dropped connection)."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before the first GET drops
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (method, path, Range header)

    def add(self, repo_id: str, files: dict[str, bytes], gated: bool = False) -> None:
        self.repos[repo_id] = Repo(dict(files), gated)

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)")
INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/?]+))?(?:\?.*)?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>[^?]+)")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        self.hub.requests.append((self.command, self.path, self.headers.get("Range")))
        for pattern, handler in ((TREE, self._tree), (RESOLVE, self._resolve), (INFO, self._info)):
            match = pattern.match(self.path)
            if match:
                repo = self._repo(match["repo"])
                if repo is not None:
                    handler(repo, match, head)
                return
        self._error(404, "RepoNotFound", "no such endpoint")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        elif repo.gated and not self.headers.get("Authorization"):
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
            return None
        return repo

    def _revision_ok(self, match) -> bool:
        if match["rev"] in (None, "main", COMMIT):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {match['rev']}")
        return False

    def _tree(self, repo: Repo, match, head: bool) -> None:
        if self._revision_ok(match):
            entries = [{"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                       for path, data in sorted(repo.files.items())]
            self._json(entries)

    def _info(self, repo: Repo, match, head: bool) -> None:
        if self._revision_ok(match):
            self._json({"id": match["repo"], "sha": COMMIT, "siblings": [{"rfilename": p} for p in repo.files]})

    def _resolve(self, repo: Repo, match, head: bool) -> None:
        if not self._revision_ok(match):
            return
        path = match["path"]
        data = repo.files.get(path)
        if data is None:
            self._error(404, "EntryNotFound", f"{path} does not exist")
            return
        start = 0
        ranged = re.match(r"bytes=(\d+)-$", self.headers.get("Range") or "")
        if ranged and not head:
            start = int(ranged[1])
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        cut = self.hub.cut_once.pop(path, None)
        if cut is not None:  # part of it, then the connection dropped
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)

    def _json(self, value) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
