"""``RetryingChannel``: the gRPC channel to the coordinator, and its calls retried while the coordinator is away.

Every call of :class:`peer.coordinator_client.CoordinatorClient` goes through :meth:`RetryingChannel.call`:
a transient failure is retried with exponential backoff and full jitter for up to ``retry_timeout``, a
refusal is turned into the error a user can act on (:func:`peer.coordinator_client.messages.refusal`).
The first time gRPC cannot reach a coordinator that never answered, it finds out what answers at the
address instead (:func:`peer.coordinator_client.transport.what_answers`): another protocol fails at once
(:class:`~peer.coordinator_client.messages.NotACoordinator`), nothing at all within
:data:`FIRST_CONTACT_TIMEOUT`. Separate from the client, which says what each call means: this is how
any call reaches the coordinator.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import grpc

from models.errors import HivepathError
from models.settings import COORDINATOR_PORT
from peer.coordinator_client.messages import CoordinatorUnavailable, NotACoordinator, refusal
from peer.coordinator_client.transport import HTTP1, HTTP2, KEEPALIVE_OPTIONS, NOTHING, TLS, Answer, what_answers
from protos import transport as transport_limits
from protos.hivepath.coordinator.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["RetryingChannel", "FIRST_CONTACT_TIMEOUT", "MAX_REPLY_BYTES", "RETRIABLE"]

log = logging.getLogger(__name__)

MAX_REPLY_BYTES = transport_limits.MAX_REPLY_BYTES
"""Status replies list every live peer; the coordinator sends no larger reply (:mod:`protos.transport`)."""

FIRST_CONTACT_TIMEOUT = 10.0
"""Seconds a client retries an address where nothing answers (connection refused, no reply) before the
coordinator ever answered it: a wrong host or port is named within this, not after ``retry_timeout``.
A coordinator that answered once, or one the caller is starting (``expect_starting``), is retried
for ``retry_timeout``."""
RETRIABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Status codes of a coordinator that is away or busy, not of one that refused."""


class NotFound(Exception):
    """The coordinator answered NOT_FOUND to a call made with ``retry_not_found=False`` (an unknown lease)."""


class Closed(CoordinatorUnavailable):
    """The channel was closed while a call waited to be retried."""


class RetryingChannel:
    """The channel to ``address`` (TLS with ``tls_ca``, the CA's certificate file) and its
    :attr:`stub`; :meth:`call` retries. ``rpc_timeout``, ``retry_timeout`` (None: forever),
    ``backoff_base`` and ``backoff_max`` are seconds and may be changed between calls."""

    def __init__(self, address: str, tls_ca: Optional[str], rpc_timeout: float, retry_timeout: Optional[float],
                 backoff_base: float, backoff_max: float, seed: Optional[int], expect_starting: bool):
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.retry_timeout = retry_timeout
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.rng = random.Random(seed)
        self.closed = threading.Event()
        options = [("grpc.max_receive_message_length", MAX_REPLY_BYTES), *KEEPALIVE_OPTIONS]
        if tls_ca:
            try:
                ca = Path(tls_ca).read_bytes()
            except OSError as e:
                raise HivepathError(f"--tls-ca {tls_ca}: cannot read ({e})") from None
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self._channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(self.address, options=options)
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        self._tls = bool(tls_ca)
        self._expect_starting = expect_starting  # a coordinator we just started: nothing answering is no news
        self._answered = False  # the coordinator answered a call once: no more address diagnosis
        self._answer: Optional[Answer] = None  # what answered at the address when gRPC first could not

    def close(self) -> None:
        """Close the channel (set :attr:`closed` first: calls waiting to be retried raise :class:`Closed`)."""
        self._channel.close()

    def call(self, method: Callable[..., Any], request: Any, retry_not_found: bool = True) -> Any:
        """``method(request)`` (a method of :attr:`stub`), retried while the coordinator is away; its refusal
        raised as the error it means (:func:`~peer.coordinator_client.messages.refusal`), NOT_FOUND as
        :class:`NotFound` when not ``retry_not_found``."""
        started = time.monotonic()
        deadline = None if self.retry_timeout is None else started + self.retry_timeout
        attempt = 0
        while True:
            if self.closed.is_set():
                raise Closed("the client is closed")
            try:
                reply = method(request, timeout=self.rpc_timeout)
                self._answered = True
                return reply
            except grpc.RpcError as e:
                code, detail = e.code(), e.details() or ""
                if code == grpc.StatusCode.NOT_FOUND and not retry_not_found:
                    raise NotFound(detail) from None
                if code in RETRIABLE:
                    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self._diagnose()
                    delay = self.rng.uniform(0, min(self.backoff_max, self.backoff_base * 2**attempt))
                    attempt += 1
                    now = time.monotonic()
                    if self._nothing_at_address() and now + delay > started + FIRST_CONTACT_TIMEOUT and (
                            deadline is None or deadline > started + FIRST_CONTACT_TIMEOUT):
                        raise CoordinatorUnavailable(
                            f"coordinator {self.address}: {self._answer.text} after {now - started:.0f}s; check the "
                            f"address (the coordinator's gRPC port is {COORDINATOR_PORT} unless 'coordinator serve "
                            "--port' says otherwise) and that 'hivepath coordinator serve' runs there") from None
                    if deadline is not None and now + delay > deadline:
                        what = f"; {self._answer.text}" if self._answer and self._answer.kind == NOTHING else ""
                        raise CoordinatorUnavailable(
                            f"coordinator {self.address} unreachable for {self.retry_timeout:.0f}s ({code.name}: "
                            f"{detail}{what}); check the address and that 'hivepath coordinator serve' runs there"
                        ) from None
                    log.debug("coordinator %s: %s; retrying in %.2fs", self.address, code.name, delay)
                    if self.closed.wait(delay):
                        raise Closed("the client is closed") from None
                    continue
                self._answered = True
                raise refusal(code, detail, self.address) from None

    def _nothing_at_address(self) -> bool:
        """Nothing answered at the address when gRPC first failed, the coordinator never answered since,
        and it is not one we are starting ourselves: a wrong address far more often than a slow start."""
        return (self._answer is not None and self._answer.kind == NOTHING and not self._answered
                and not self._expect_starting)

    def _diagnose(self) -> None:
        """The first time gRPC cannot reach a coordinator that never answered: find out what answers at
        the address. Another protocol (TLS where we speak plain text, plain text where we speak TLS, an
        HTTP/1 server such as the status page) is a wrong address or flag: :class:`NotACoordinator`
        (exit 2) at once, instead of retrying for ``retry_timeout``. Nothing at all may be a coordinator
        still starting: one warning line, and the retries go on."""
        if self._answered or self._answer is not None:
            return
        answer = self._answer = what_answers(self.address)
        port_hint = (f"the coordinator's gRPC port is {COORDINATOR_PORT} unless 'coordinator serve --port' "
                     "says otherwise")
        if answer.kind == NOTHING and self._expect_starting:
            log.debug("coordinator %s: %s; waiting for it to start", self.address, answer.text)
        elif answer.kind == NOTHING:
            limit = FIRST_CONTACT_TIMEOUT if self.retry_timeout is None else min(FIRST_CONTACT_TIMEOUT,
                                                                                  self.retry_timeout)
            retry = f" for up to {limit:.0f}s"
            log.warning("coordinator %s: %s; retrying%s (is 'hivepath coordinator serve' running there? %s)",
                        self.address, answer.text, retry, port_hint)
        elif answer.kind == TLS and not self._tls:
            raise NotACoordinator(f"coordinator {self.address}: {answer.text}; pass --tls-ca with the CA that "
                                  "signed its certificate")
        elif answer.kind == HTTP2 and self._tls:
            raise NotACoordinator(f"coordinator {self.address}: {answer.text}, but --tls-ca asks for TLS; drop "
                                  "--tls-ca, or serve the coordinator with --tls-cert/--tls-key")
        elif answer.kind == HTTP1:
            raise NotACoordinator(f"coordinator {self.address}: {answer.text}, not gRPC (the coordinator's status "
                                  f"page?); {port_hint}")
        elif answer.kind not in (TLS, HTTP2):
            raise NotACoordinator(f"coordinator {self.address}: {answer.text}; {port_hint}")

