"""Whether the worker's store answers, watched from start to stop: a worker whose store is
gone serves hot agents from RAM but can neither restore nor persist, and says so in its log
and in health (the service STORE_HEALTH), not silently."""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agentkv.client.store import StoreClient
from agentkv.errors import (
    NOT_HTTP2,
    AgentKVError,
    FailedPrecondition,
    Unauthenticated,
    connect_failure,
)
from agentkv.v1 import store_pb2

log = logging.getLogger("agentkv.worker")
STORE_HEALTH = "agentkv.worker.store"  # SERVING while the store answers, else NOT_SERVING
STORE_SERVICE = store_pb2.DESCRIPTOR.services_by_name["CacheStore"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class StoreHealth:
    """Asks the store's health now and every `interval` seconds until close(); logs each
    change, a warning when it stops answering, and sets STORE_HEALTH in `servicer`. The
    first ask waits `first_timeout`: it opens the connection too (a WAN link's round trips,
    TLS's), where a store nobody listens at is refused at once."""

    def __init__(
        self,
        store: StoreClient,
        address: str,
        servicer: health.HealthServicer,
        interval: float = 5.0,
        timeout: float = 2.0,
        first_timeout: float = 10.0,
    ) -> None:
        self.store, self.address, self.servicer = store, address, servicer
        self.interval, self.timeout = interval, timeout
        self._health = health_pb2_grpc.HealthStub(store.channel)
        self.answering: bool | None = None
        self._stop = threading.Event()
        self.check(first_timeout)  # before the worker says "serving"
        self._thread = threading.Thread(target=self._run, name="store-health", daemon=True)
        self._thread.start()

    def check(self, timeout: float | None = None) -> bool:
        """Asks the store's grpc.health.v1 (open to every caller, no token needed) of the
        store's service (a server that is no store answers NOT_FOUND), waiting `timeout`
        seconds (the watch's own by default)."""
        try:
            request = health_pb2.HealthCheckRequest(service=STORE_SERVICE)
            reply = self._health.Check(request, timeout=timeout or self.timeout)
            answering = reply.status == SERVING
            reason = (
                "" if answering else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            )
        except grpc.RpcError as exc:
            answering, reason = False, exc.details() or exc.code().name
        except Exception as exc:  # a closed channel at shutdown: say so, keep watching
            answering, reason = False, repr(exc)
        if answering != self.answering:  # logged first: health then says what the log did
            if answering:
                log.info("store answers", extra={"store": self.address})
            else:
                log.warning(
                    "store does not answer: hot agents are served from RAM, but nothing can "
                    "be restored or persisted until it does",
                    extra={"store": self.address, "error": reason},
                )
            self.servicer.set(STORE_HEALTH, SERVING if answering else NOT_SERVING)
        self.answering = answering
        return answering

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def check_store(store: StoreClient, address: str, timeout: float) -> None:
    """Raises when the server at the worker's --store answers but is no agentkv store (a
    gRPC server without the store's service, or one that does not speak HTTP/2 at all, such
    as an HTTP server), or refuses the worker's token: the worker could never use it (every
    turn would fail, and the gateway would answer its callers 401 for the worker's own
    token). One that does not answer (down, not started yet, hung, or behind a proxy that
    has no store to pass the call to yet) is no error here: the worker serves hot agents
    meanwhile, and StoreHealth says so. One call tells them all: the store's GetStats,
    which another server does not serve and a store serves only with a token it knows."""
    try:
        store.call("GetStats", store_pb2.GetStatsRequest(), timeout)
    except Unauthenticated as exc:
        raise Unauthenticated(
            f"the store at --store {address} refuses this worker's token ({exc.message}): "
            "give --store-token-file (or AGENTKV_STORE_TOKEN_FILE) a token its --auth-tokens holds"
        ) from None
    except AgentKVError as exc:  # PERMISSION_DENIED: a token it knows, for some namespaces
        if exc.code == grpc.StatusCode.UNIMPLEMENTED and not exc.remote:
            raise FailedPrecondition(
                f"the server at --store {address} is not an agentkv store: it serves no "
                f"{STORE_SERVICE} ({exc.code.name})"
            ) from None
        if exc.code == grpc.StatusCode.UNAVAILABLE and not exc.remote and NOT_HTTP2 in exc.message:
            raise FailedPrecondition(
                f"the server at --store {address} is not an agentkv store: it does not speak "
                f"gRPC's HTTP/2 (gRPC: {connect_failure(exc.message)})"
            ) from None
