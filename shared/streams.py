"""Every Redis stream and key name SuperInfer uses, in one place."""

from __future__ import annotations

PREFIX = "superinfer"

# Redis hash holding the SLO knobs and their version (written validated by the admin path).
KNOBS_KEY = f"{PREFIX}:knobs"
# Sorted set worker id -> unix seconds of its newest snapshot or heartbeat, written with each:
# control-plane replicas find the workers to plan here (one whose score stops changing is gone).
SNAPSHOT_WORKERS_KEY = f"{PREFIX}:snapshot-workers"
# Stream of {"w": worker id}, one entry at each worker incarnation's first snapshot: replicas
# block on it beside their workers' streams, so a new worker is leased at once.
WORKERS_JOINED_STREAM = f"{PREFIX}:snapshot-workers:joined"
MAXLEN_WORKERS_JOINED = 1_000
# Hash worker id -> its last heartbeat, an encoded WorkerStatus (time, load, knobs version...),
# for readiness and routing.
WORKERS_KEY = f"{PREFIX}:workers"
# Hash gateway id -> last heartbeat (unix seconds), written by each gateway's heartbeat thread.
# A worker aborts the requests of a gateway whose heartbeat stopped changing, each ending with
# an error on its output stream (data_plane/orphans.py); entries older than a worker's
# gateway_forget_s go, with the output streams of those it called dead.
GATEWAYS_KEY = f"{PREFIX}:gateways"
# Key the control plane refreshes (with a TTL) while it runs.
CONTROL_PLANE_HEARTBEAT_KEY = f"{PREFIX}:control-plane:alive"
# Sorted set of live control-plane replicas: replica token -> expiry (unix ms), refreshed with
# each replica's lease renewal; its size is how many replicas share the workers.
CONTROL_PLANE_REPLICAS_KEY = f"{PREFIX}:control-plane:replicas"
# Consumer group of a worker on its own request stream.
WORKER_GROUP = "worker"


def worker_requests_stream(worker_id: str) -> str:
    """Requests and aborts for one worker (read through the consumer group)."""
    return f"{PREFIX}:worker:{worker_id}:requests"


def worker_snapshots_stream(worker_id: str) -> str:
    """One worker's per-iteration state snapshots, read only by the control-plane replica
    holding its lease (so Redis ships each snapshot once, whatever the number of replicas)."""
    return f"{PREFIX}:worker:{worker_id}:snapshots"


def worker_of_snapshots_stream(stream: str) -> str | None:
    """The worker whose snapshot stream ``stream`` is (None: not one of ours)."""
    return _middle(stream, f"{PREFIX}:worker:", ":snapshots")


def _middle(name: str, head: str, tail: str) -> str | None:
    """What ``name`` holds between ``head`` and ``tail`` (None: not that shape, or empty)."""
    if name.startswith(head) and name.endswith(tail) and len(name) > len(head + tail):
        return name[len(head) : -len(tail)]
    return None


def worker_streams(worker_id: str) -> list[str]:
    """Every stream of one worker: its requests, snapshots and plans."""
    return [
        worker_requests_stream(worker_id),
        worker_snapshots_stream(worker_id),
        worker_plans_stream(worker_id),
    ]


def worker_plans_stream(worker_id: str) -> str:
    """Rotation plans for one worker, written by the control plane."""
    return f"{PREFIX}:worker:{worker_id}:plans"


def worker_owner_key(worker_id: str) -> str:
    """The lease: the token of the control-plane replica that plans for this worker (SET NX
    PX, renewed and released only by its holder; control_plane/lease.py)."""
    return f"{PREFIX}:worker:{worker_id}:owner"


def worker_plan_fence_key(worker_id: str) -> str:
    """Hash {epoch, iteration} of the newest snapshot a plan was published for: a plan for the
    same or an older iteration of that epoch is refused, whichever replica sends it."""
    return f"{PREFIX}:worker:{worker_id}:planned"


def gateway_outputs_stream(gateway_id: str) -> str:
    """Token outputs for the requests one gateway (or client) submitted."""
    return f"{PREFIX}:gateway:{gateway_id}:outputs"


def gateway_of_outputs_stream(stream: str) -> str | None:
    """The gateway whose output stream ``stream`` is (None: not one of ours)."""
    return _middle(stream, f"{PREFIX}:gateway:", ":outputs")


# Stream lengths are capped (approximate MAXLEN) so Redis memory stays bounded in long runs. A
# worker deletes each request-stream entry once it acknowledged it (XACK, then XDEL), so that
# stream holds only entries not yet read or still pending; its MAXLEN is a last resort that
# admission (per-worker queue bounds) keeps from being reached.
MAXLEN_REQUESTS = 100_000
MAXLEN_PLANS = 1_000
# Exact: only a worker's newest snapshot matters (a whole 4,096-request table is ~135 KB).
MAXLEN_WORKER_SNAPSHOTS = 4
WORKER_SNAPSHOTS_TTL_MS = 60_000  # a worker's snapshot stream outlives its newest entry so long
# An output entry is one worker iteration's TokenOutputs batch for that gateway (up to one
# output per running request, ~67 bytes each): 4,096 entries are ~200 s of one worker at 20
# iterations/s, ~25 s of eight, and at most 4,096 x the batch size in bytes.
MAXLEN_OUTPUTS = 4_096

# Hash SLO class name -> msgpack {ttft_s, tbt_s}, plus "version" (written validated by the admin
# API; gateways attach a class's S_F/S_B to each request).
SLO_CLASSES_KEY = f"{PREFIX}:slo-classes"
# Hash sha256(API key) -> msgpack {tenant, slo_class}: keys are never stored in the clear.
API_KEYS_KEY = f"{PREFIX}:api-keys"
API_KEYS_VERSION_KEY = f"{API_KEYS_KEY}:version"  # bumped by every create and delete
# Per-request lifecycle hash (arrival, worker, admitted, rotations, first token, finish),
# written by the gateway and the worker, expiring after LIFECYCLE_TTL_S.
LIFECYCLE_TTL_S = 3600


def request_lifecycle_key(request_id: str) -> str:
    return f"{PREFIX}:request:{request_id}"


def response_key(response_id: str) -> str:
    """A stored response of the Responses API: a JSON string with a TTL
    (gateway/response_store.py)."""
    return f"{PREFIX}:response:{response_id}"
