"""Servers of a caller's own, on free ports of 127.0.0.1: Redis and PostgreSQL, for what
stops and starts them (fault tests, the chaos harness: stopping the machine's servers
would fail whatever else uses them), and an OpenAI-compatible model server, for the
agents of tasks bound to a Workspace.

Each raises ``ServerUnavailable`` when its binaries are not installed; nothing here knows
about pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from orchestrator.devcluster.broker import free_port
from orchestrator.testing import ServerUnavailable
from worker_agent.testing import wait_until

__all__ = ["ModelServer", "PostgresServer", "RedisServer", "free_port"]


class RedisServer:
    """``redis-server`` on ``port`` (a free one by default). ``persistent``: an
    append-only file in ``directory``, written every second, as a broker that must
    survive its restarts is run; a graceful stop writes it whole, so a restart finds
    every message."""

    def __init__(
        self, port: int | None = None, directory: Path | None = None, persistent: bool = False
    ) -> None:
        if shutil.which("redis-server") is None:
            raise ServerUnavailable("redis-server is not installed")
        self.port = port or free_port()
        self.directory = directory
        self.persistent = persistent
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> subprocess.Popen[bytes]:
        import redis

        argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        if self.persistent:
            assert self.directory is not None, "a persistent server needs a directory"
            argv += ["--dir", str(self.directory), "--appendonly", "yes",
                     "--appendfsync", "everysec"]  # fmt: skip
        else:
            argv += ["--appendonly", "no"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def up() -> bool:
            try:
                return bool(redis.Redis(port=self.port, socket_connect_timeout=0.5).ping())
            except redis.exceptions.BusyLoadingError:
                return False  # still reading its append-only file
            except redis.ConnectionError:
                return False

        wait_until(up, 30, f"redis on port {self.port}")
        return self.proc

    def stop(self, graceful: bool = True) -> None:
        """SIGTERM (Redis writes what it holds and exits) or SIGKILL."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
            self.proc.wait(60)
            self.proc = None


class PostgresServer:
    """A PostgreSQL cluster of its own in a temporary directory, on a free port; as root
    it runs as the ``postgres`` user (the server refuses root, and the directory is in
    the system's temporary directory, which that user can reach)."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
        if not bins:
            raise ServerUnavailable(
                "PostgreSQL's server binaries are not installed (/usr/lib/postgresql)"
            )
        self.bin = bins[-1].parent
        self.port = free_port()
        self.data = Path(tempfile.mkdtemp(prefix="drain-pg-"))
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None
        self.as_postgres: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.data, "postgres", "postgres")
            self.as_postgres = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
        subprocess.run(
            [*self.as_postgres, str(self.bin / "initdb"), f"--pgdata={self.data}",
             "--username=postgres", "--auth=trust", "--encoding=UTF8", "--locale=C.UTF-8",
             "--no-sync"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip

    def start(self) -> None:
        import sqlalchemy as sa

        self.proc = subprocess.Popen(
            [*self.as_postgres, str(self.bin / "postgres"), "-D", str(self.data),
             "-k", str(self.data), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

        def answers() -> bool:
            engine = sa.create_engine(self.url)
            try:
                with engine.connect() as conn:
                    return bool(conn.execute(sa.text("SELECT 1")).scalar_one() == 1)
            except sa.exc.OperationalError:
                return False  # not listening yet, or still starting up
            finally:
                engine.dispose()

        wait_until(answers, 30, f"PostgreSQL on port {self.port} to answer")

    def stop(self) -> None:
        """A fast shutdown (SIGINT): open transactions are rolled back."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.data, ignore_errors=True)


class ModelServer(ThreadingHTTPServer):
    """An OpenAI-compatible chat-completions endpoint: each request answered with
    ``reply(body)`` and recorded in ``requests`` as (path, Authorization, body). Serves
    from a thread of its own once ``start`` is called; ``shutdown`` stops it."""

    daemon_threads = True

    def __init__(self, reply: Callable[[dict[str, Any]], str]) -> None:
        super().__init__(("127.0.0.1", 0), _ModelHandler)
        self.reply = reply
        self.requests: list[tuple[str, str, dict[str, Any]]] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def start(self) -> ModelServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _ModelHandler(BaseHTTPRequestHandler):
    server: ModelServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.server.requests.append((self.path, self.headers.get("Authorization", ""), body))
        message = {"role": "assistant", "content": self.server.reply(body)}
        answer = json.dumps({"choices": [{"message": message}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer.encode())

    def log_message(self, *_: Any) -> None:
        pass  # no line per request on stderr
