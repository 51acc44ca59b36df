"""Spot-instance preemption notices: watch the cloud's metadata endpoint and drain before the end.

Spot (AWS) and preemptible/Spot (GCP) machines are reclaimed with a short notice: AWS posts an
*instance action* two minutes ahead (``/latest/meta-data/spot/instance-action``, read with an IMDSv2
session token), GCP flips ``/computeMetadata/v1/instance/preempted`` to ``TRUE`` about 30 seconds
ahead. A :class:`SpotWatcher` polls one or more :class:`NoticeSource` s and calls a callback once, on
the first notice; the peer wires that callback to ``PeerNode.request_stop(reason, preempting=True)``
so it finishes or abandons its round, checkpoints, tells the coordinator and exits 0 in time.

Only a clear answer is a notice. An endpoint that times out, refuses the connection, answers 404 (AWS:
no action scheduled), answers ``FALSE`` (GCP) or answers something malformed is *not* a preemption:
a laptop or an on-demand machine must never drain itself because a metadata server is absent.

Pure standard library (``urllib``), so it adds nothing to the image. ``python -m peer.node.spot -- CMD``
runs CMD under a watcher that sends it SIGTERM (hivepath's drain signal) on a notice: the container
images use it, configured by ``HIVEPATH_SPOT*`` variables.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Mapping, Optional, Protocol, Sequence

from models.errors import ConfigError
from peer import settings

__all__ = [
    "SpotNotice",
    "NoticeSource",
    "AwsSpotNotice",
    "GcpPreemptionNotice",
    "SpotWatcher",
    "SpotOptions",
    "build_sources",
    "supervise",
    "AWS_METADATA_URL",
    "GCP_METADATA_URL",
    "ENV_VARS",
]

log = logging.getLogger(__name__)

AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"
GCP_NOTICE_SECONDS = 30.0
"""GCP documents a 30 s preemption notice; its endpoint carries no deadline of its own."""
ENV_VARS = ("HIVEPATH_SPOT", "HIVEPATH_SPOT_URL", "HIVEPATH_SPOT_POLL_INTERVAL")
"""The environment variables :meth:`SpotOptions.from_env` reads."""
PROVIDERS: tuple[str, ...] = settings.setting("HIVEPATH_SPOT").choices


@dataclass(frozen=True)
class SpotNotice:
    """One preemption notice, as the cloud announced it."""

    provider: str
    """``aws`` or ``gcp``."""
    action: str
    """What the cloud will do: ``terminate``, ``stop``, ``hibernate`` (AWS) or ``preempt`` (GCP)."""
    deadline: Optional[float]
    """Wall-clock time (``time.time()`` seconds) the machine goes away, when known."""
    detail: str = ""
    """The endpoint's raw answer, for the log."""

    def seconds_left(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds until :attr:`deadline` (negative once past), or None if the cloud gave none."""
        if self.deadline is None:
            return None
        return self.deadline - (time.time() if now is None else now)

    def describe(self) -> str:
        """A one-line reason for logs and the coordinator's drain record."""
        left = self.seconds_left()
        when = f", {left:.0f}s left" if left is not None else ""
        return f"spot preemption notice ({self.provider}: {self.action}{when})"


class NoticeSource(Protocol):
    """Anything that can say whether this machine is about to be reclaimed."""

    name: str

    def check(self) -> Optional[SpotNotice]:
        """A notice if one is posted now; None otherwise, including when the endpoint does not answer."""
        ...


def _request(url: str, *, method: str = "GET", headers: Optional[dict] = None,
             request_timeout: float = 1.0) -> tuple[Optional[int], bytes, dict]:
    """``(status, body, headers)``; status None when nothing answered (timeout, refused, DNS)."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    # Metadata servers are link-local: never go through an HTTP proxy from the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=request_timeout) as resp:
            return resp.status, resp.read(64 * 1024), dict(resp.headers.items())
    except urllib.error.HTTPError as e:
        try:
            body = e.read(64 * 1024)
        except OSError:
            body = b""
        return e.code, body, dict(e.headers.items()) if e.headers else {}
    except (urllib.error.URLError, OSError, ValueError) as e:
        log.debug("no answer from %s: %s", url, e)
        return None, b"", {}


class AwsSpotNotice:
    """AWS EC2 Spot: ``GET /latest/meta-data/spot/instance-action`` with an IMDSv2 token.

    The token comes from ``PUT /latest/api/token`` and is reused until shortly before it expires; a
    401 (expired token) fetches a new one once. If the token request gets an HTTP error (IMDSv1-only
    instance) the read is tried without a token. 404 means no action is scheduled.
    """

    name = "aws"

    def __init__(self, base_url: str = AWS_METADATA_URL, request_timeout: float = 1.0, token_ttl: int = 21600):
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.token_ttl = token_ttl
        self._token: Optional[str] = None
        self._token_expires = 0.0

    def _fetch_token(self) -> Optional[str]:
        status, body, _ = _request(
            f"{self.base_url}/latest/api/token", method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
            request_timeout=self.request_timeout,
        )
        if status == 200 and body.strip():
            self._token = body.decode("ascii", "replace").strip()
            self._token_expires = time.monotonic() + self.token_ttl * 0.9
            return self._token
        self._token = None
        return None

    def _read_action(self, token: Optional[str]) -> tuple[Optional[int], bytes]:
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        status, body, _ = _request(f"{self.base_url}/latest/meta-data/spot/instance-action", headers=headers,
                                   request_timeout=self.request_timeout)
        return status, body

    def check(self) -> Optional[SpotNotice]:
        token = self._token if self._token and time.monotonic() < self._token_expires else self._fetch_token()
        status, body = self._read_action(token)
        if status == 401 and token is not None:
            status, body = self._read_action(self._fetch_token())
        if status != 200:
            return None
        return self._parse(body)

    def _parse(self, body: bytes) -> Optional[SpotNotice]:
        text = body.decode("utf-8", "replace").strip()
        try:
            doc = json.loads(text)
            action = str(doc["action"]).strip().lower()
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed AWS instance-action answer: %.200r", text)
            return None
        if action not in ("terminate", "stop", "hibernate"):
            log.warning("ignoring an AWS instance-action with unknown action %r", action)
            return None
        deadline = None
        raw_time = doc.get("time")
        if isinstance(raw_time, str):
            try:
                deadline = datetime.fromisoformat(raw_time.replace("Z", "+00:00")).timestamp()
            except ValueError:
                log.warning("AWS instance-action time %r is not ISO 8601; no deadline known", raw_time)
        return SpotNotice("aws", action, deadline, text)


class GcpPreemptionNotice:
    """GCP preemptible and Spot VMs: ``GET /computeMetadata/v1/instance/preempted`` is ``TRUE``.

    The request carries ``Metadata-Flavor: Google`` and the answer must carry it back (the metadata
    server always does), so an unrelated web server at that address is never taken for a notice.
    """

    name = "gcp"

    def __init__(self, base_url: str = GCP_METADATA_URL, request_timeout: float = 1.0,
                 notice_seconds: float = GCP_NOTICE_SECONDS):
        self.base_url = base_url.rstrip("/")
        self.request_timeout = request_timeout
        self.notice_seconds = notice_seconds

    def check(self) -> Optional[SpotNotice]:
        status, body, headers = _request(
            f"{self.base_url}/computeMetadata/v1/instance/preempted",
            headers={"Metadata-Flavor": "Google"}, request_timeout=self.request_timeout,
        )
        if status != 200:
            return None
        flavor = {k.lower(): v for k, v in headers.items()}.get("metadata-flavor", "")
        if flavor.lower() != "google":
            log.warning("ignoring a preempted answer without 'Metadata-Flavor: Google' from %s", self.base_url)
            return None
        text = body.decode("utf-8", "replace").strip()
        if text.upper() != "TRUE":
            if text.upper() != "FALSE":
                log.warning("ignoring a malformed GCP preempted answer: %.200r", text)
            return None
        return SpotNotice("gcp", "preempt", time.time() + self.notice_seconds, text)


@dataclass(frozen=True)
class SpotOptions:
    """Which notices to watch: ``HIVEPATH_SPOT``, ``HIVEPATH_SPOT_URL``, ``HIVEPATH_SPOT_POLL_INTERVAL``."""

    provider: str = settings.default("HIVEPATH_SPOT")
    """``none`` (off), ``aws``, ``gcp`` or ``auto`` (both; only the cloud we are on will answer)."""
    base_url: Optional[str] = None
    """Metadata server base URL (default: the provider's own); a fake server in tests."""
    poll_interval: float = settings.default("HIVEPATH_SPOT_POLL_INTERVAL")
    """Seconds between checks; keep it well under the notice time (30 s on GCP)."""
    request_timeout: float = 1.0
    """Seconds one metadata request may take before it counts as no answer."""

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ConfigError("spot", f"unknown spot provider {self.provider!r}; use one of {', '.join(PROVIDERS)}")
        if not self.poll_interval > 0:
            raise ConfigError("spot-poll-interval", f"{self.poll_interval} must be a positive number of seconds")
        if not self.request_timeout > 0:
            raise ConfigError("spot", f"request timeout {self.request_timeout} must be positive")
        if self.provider == "none" and self.base_url:
            log.warning("--spot-url %s is ignored: no notice is watched with --spot none (pass --spot aws, gcp "
                        "or auto to watch it)", self.base_url)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "SpotOptions":
        """Options from the ``HIVEPATH_SPOT*`` variables (:mod:`peer.settings`; unset: watching is off)."""
        return cls(provider=str(settings.read("HIVEPATH_SPOT", environ)).lower(),
                   base_url=settings.read("HIVEPATH_SPOT_URL", environ),
                   poll_interval=settings.read("HIVEPATH_SPOT_POLL_INTERVAL", environ))


def build_sources(opts: SpotOptions) -> list[NoticeSource]:
    """The notice sources ``opts`` names (empty for ``none``)."""
    sources: list[NoticeSource] = []
    if opts.provider in ("aws", "auto"):
        sources.append(AwsSpotNotice(opts.base_url or AWS_METADATA_URL, request_timeout=opts.request_timeout))
    if opts.provider in ("gcp", "auto"):
        sources.append(GcpPreemptionNotice(opts.base_url or GCP_METADATA_URL, request_timeout=opts.request_timeout))
    return sources


class SpotWatcher:
    """Polls notice sources in a daemon thread and calls ``on_notice`` once, on the first notice.

    >>> watcher = SpotWatcher(build_sources(SpotOptions.from_env()),
    ...                       lambda n: node.request_stop(n.describe(), preempting=True))
    >>> watcher.start()  # ... watcher.stop() on shutdown
    """

    def __init__(self, sources: Sequence[NoticeSource], on_notice: Callable[[SpotNotice], None],
                 poll_interval: float = 5.0):
        if not poll_interval > 0:
            raise ConfigError("spot-poll-interval", f"{poll_interval} must be a positive number of seconds")
        self.sources = list(sources)
        self.on_notice = on_notice
        self.poll_interval = poll_interval
        self.notice: Optional[SpotNotice] = None
        self.polls = 0
        """Completed polling rounds (all sources checked once), for tests and status."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def from_options(cls, opts: SpotOptions, on_notice: Callable[[SpotNotice], None]) -> "SpotWatcher":
        return cls(build_sources(opts), on_notice, poll_interval=opts.poll_interval)

    def check_once(self) -> Optional[SpotNotice]:
        """Check every source once; the first notice found, else None. A failing source is skipped."""
        try:
            for source in self.sources:
                try:
                    notice = source.check()
                except Exception:  # a bug in one source must not stop the watch nor fake a notice
                    log.exception("spot notice source %s failed", getattr(source, "name", source))
                    continue
                if notice is not None:
                    return notice
            return None
        finally:
            self.polls += 1

    def start(self) -> "SpotWatcher":
        """Start polling in the background (a no-op without sources)."""
        if not self.sources or self._thread is not None:
            return self
        names = ", ".join(s.name for s in self.sources)
        log.info("watching for spot preemption notices (%s) every %.1fs", names, self.poll_interval)
        self._thread = threading.Thread(target=self._loop, name="spot-watcher", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            notice = self.check_once()
            if notice is not None and not self._stop.is_set():
                self.notice = notice
                log.warning("%s: draining", notice.describe())
                try:
                    self.on_notice(notice)
                except Exception:
                    log.exception("the spot notice callback failed")
                return
            self._stop.wait(self.poll_interval)

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop polling; waits up to ``join_timeout`` seconds for an in-flight check."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


def supervise(cmd: Sequence[str], opts: SpotOptions) -> int:
    """Run ``cmd``; on a spot notice send it one SIGTERM (drain). Returns its exit code (128 + N when
    signal N killed it).

    SIGTERM and SIGINT received here are forwarded to the child, so under ``docker stop`` the peer
    drains exactly as it would without the supervisor. The child runs with ``HIVEPATH_SPOT=none``: the
    supervisor is the one watcher. A child watching too (``hivepath peer join`` reads that variable)
    would drain on its own first, and our SIGTERM could then reach it while the interpreter exits,
    when Python's handlers are gone, turning a clean drain into a death by SIGTERM (exit 143).
    """
    # the supervisor is the one watcher: the child gets watching off, and none of the watcher's settings
    env = {k: v for k, v in os.environ.items() if k not in ("HIVEPATH_SPOT_URL", "HIVEPATH_SPOT_POLL_INTERVAL")}
    child = subprocess.Popen(list(cmd), env={**env, "HIVEPATH_SPOT": "none"})
    sent = threading.Lock()

    def on_notice(notice: SpotNotice) -> None:
        if sent.acquire(blocking=False) and child.poll() is None:
            log.warning("%s: sending SIGTERM to %s", notice.describe(), cmd[0])
            child.send_signal(signal.SIGTERM)

    def forward(signum: int, _frame) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    watcher = SpotWatcher.from_options(opts, on_notice).start()
    try:
        code = child.wait()
    finally:
        watcher.stop()
    return 128 - code if code < 0 else code  # killed by signal N: the shell's convention, 128 + N


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m peer.node.spot [--provider P] [--url URL] [--poll-interval S] -- CMD ...``."""
    try:
        env = SpotOptions.from_env()
    except ConfigError as e:
        sys.stderr.write(f"hivepath: error: {e}\n")
        return e.exit_code
    parser = argparse.ArgumentParser(prog="python -m peer.node.spot",
                                     description="Run CMD; send it SIGTERM when the cloud posts a spot notice.")
    parser.add_argument("--provider", default=env.provider, choices=PROVIDERS, help="env HIVEPATH_SPOT")
    parser.add_argument("--url", default=env.base_url, help="metadata base URL (env HIVEPATH_SPOT_URL)")
    parser.add_argument("--poll-interval", type=float, default=env.poll_interval,
                        help="seconds between checks (env HIVEPATH_SPOT_POLL_INTERVAL)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given; put it after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        opts = SpotOptions(provider=args.provider, base_url=args.url, poll_interval=args.poll_interval)
    except ConfigError as e:
        sys.stderr.write(f"hivepath: error: {e}\n")
        return e.exit_code
    return supervise(cmd, opts)


if __name__ == "__main__":
    sys.exit(main())
