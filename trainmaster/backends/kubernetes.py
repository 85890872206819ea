"""The Kubernetes backend: an instance is a Pod, a role a headless Service.

- **Where**: a kubeconfig (``--kubeconfig``, ``$KUBECONFIG``, the cluster of ``trainmaster
  cluster up``, ``~/.kube/config``) or the pod's in-cluster service account.
- **Start**: each attempt is one Pod (labels job/role/index/attempt, ``restartPolicy: Never``:
  the controller's restart policies decide), owned by the job's object (the custom resource in
  operator mode, else a ConfigMap standing for the job) so deleting it cascades; the role's
  headless Service is made once every pod made for the role has an IP (see
  :class:`_RoleService`). Pods are created by a pool of threads, so a
  pass hands over a whole gang at once (Kubernetes' Job controller creates in slow-start
  batches). A pod's address (its IP) becomes the instance's once known.
- **Dependencies** (the seed's wait step): a dependent instance's pod is created only once
  its dependencies hold, judged from the watched pods (the address registry's counterpart in
  the cluster); its environment is then resolved with their addresses. Pods reach nothing of
  the controller's store; no cluster DNS is needed.
- **Observe**: one watch of the backend's pods and one of the nodes (resourceVersion resumed,
  :mod:`trainmaster.backends.kubernetes_watch`); polls read that cache, never the API. Exits,
  OOMKilled, Evicted, image and scheduling problems become reasons a user reads
  (:func:`kubernetes_objects.pod_observation`); a pod on a node that is not Ready is Lost at once
  and deleted (grace 0), so the controller restarts it elsewhere by policy.
- **Logs**: followed through the API into the instance's log file (``trainmaster job logs``).
- **Gang admission**: the nodes' allocatable minus the requests of every pod bound to them.

Roles without an image run this machine's software in a pod (``HostRuntime``): only on a
cluster whose nodes are this machine (``trainmaster cluster up``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from trainmaster.backends import kubernetes_objects as k8s
from trainmaster.backends.base import (
    Backend,
    BackendOptions,
    GangReservation,
    LaunchRequest,
    Observation,
    Placement,
    PlacementRequest,
    Resources,
    StartFailure,
)
from trainmaster.backends.kubernetes_watch import WatchedCache, wait_until
from trainmaster.cluster import images
from trainmaster.cluster.layout import state_root
from trainmaster.contract import InstanceHandle, LaunchSpec
from trainmaster.contract import InstancePhase as Phase
from trainmaster.errors import UserError
from trainmaster.runtime.environment import instance_environment

log = logging.getLogger(__name__)

NODE = "kubernetes"
SYNC_TIMEOUT = 30.0
DELETE_TIMEOUT = 60.0
LEAD_WAIT_SECONDS = 0.5  # the most a start's other pods wait for its first pod's create
CREATE_TIMEOUT = (10, 30)  # seconds to connect and to be answered, for a pod's create
FIRST_PORT, LAST_PORT = 20000, 32000
HOST_RUNTIME_ENV = "TRAINMASTER_K8S_HOST_RUNTIME"
GATE_CHECK_SECONDS = 0.5
STOP_CONFIRM_SECONDS = 30.0  # a deleted pod still there this long past its grace is deleted with grace 0
MAX_ENDED = 10_000  # ended pods remembered for their controllers (dropped oldest first beyond)


@dataclass(frozen=True)
class KubernetesOptions:
    """``host_runtime``: run image-less roles as this machine's software in pods (None: when the
    kubeconfig is one of ``trainmaster cluster up``'s, or ``$TRAINMASTER_K8S_HOST_RUNTIME=1``).
    ``pod_names``: ``unique`` (``<job>-<role>-<i>-<hash>``) or ``kubeflow`` (``<job>-<role>-<i>``).
    ``cleanup``: delete the job's object (and so its pods and services) when it ends.
    ``namespace``: where pods go and which are watched; "" = every namespace (the operator's:
    each job's pods go to its resource's namespace)."""

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = "default"
    host_runtime: bool | None = None
    pod_names: str = "unique"
    cleanup: bool = True
    follow_logs: bool = True  # into each instance's log file (the operator leaves logs with the pods)
    create_threads: int = 16


def default_kubeconfig() -> str | None:
    """``$KUBECONFIG``, else the cluster of ``trainmaster cluster up`` (named ``tm``), else
    ``~/.kube/config``; None inside a pod (its service account is used)."""
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"].split(os.pathsep)[0]
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    ours = state_root() / "tm" / "kubeconfig"
    if ours.exists():
        return str(ours)
    home = Path.home() / ".kube" / "config"
    return str(home) if home.exists() else None


def api_client(kubeconfig: str | None, context: str | None = None) -> Any:
    """A client of the API that counts its requests (``.requests``)."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise UserError(
            f"--backend kubernetes needs the optional Kubernetes extra: pip install 'trainmaster[kubernetes]' ({exc})"
        ) from None

    class CountingClient(client.ApiClient):  # type: ignore[misc]
        requests = 0
        _count_lock = threading.Lock()

        def call_api(self, *args: Any, **kwargs: Any) -> Any:
            with self._count_lock:
                self.requests += 1
            return super().call_api(*args, **kwargs)

    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        where = kubeconfig or "the in-cluster service account"
        raise UserError(
            f"cannot use the Kubernetes cluster of {where}: {exc}; give --kubeconfig, set KUBECONFIG, "
            "or start one here with `trainmaster cluster up`"
        ) from None
    configuration.connection_pool_maxsize = 64  # creators, log followers and two watches at once
    return CountingClient(configuration)


def settle(answer: Any) -> None:
    """Give a raw answer's connection back to the client's pool (``_preload_content=False``:
    until its body is read, urllib3 keeps the connection out of the pool, and the next request
    opens a new one, TLS handshake and all; a dropped answer never gives it back)."""
    answer.drain_conn()
    answer.release_conn()


def create(options: BackendOptions) -> KubernetesBackend:
    """The registry's factory (``--backend kubernetes``): the cluster of ``options.address`` (a
    kubeconfig's path) or of :func:`default_kubeconfig`, namespace ``$TRAINMASTER_K8S_NAMESPACE``
    (default ``default``)."""
    import kubernetes  # noqa: F401  (missing: the registry names the extra to install)

    return KubernetesBackend(
        KubernetesOptions(
            kubeconfig=options.address, namespace=os.environ.get("TRAINMASTER_K8S_NAMESPACE") or "default"
        )
    )


@dataclass
class _Held:
    """A dependent instance in its wait step. ``in_pod``: its pod runs already (this machine's
    software: its first process waits for the environment file the backend writes once the
    dependencies hold, so the instance has an address, as ``Placed`` needs); else its pod is
    created only then (an image of its own: its environment is fixed at creation)."""

    spec: LaunchSpec
    since: float
    in_pod: bool = False


@dataclass
class _RoleService:
    """A role's headless Service not made yet. It is made once every pod made for the role so
    far has an IP (or is gone), and no pod of it is still being created; at the latest
    ``SERVICE_WAIT_SECONDS`` after the first was asked for (a pod that cannot be scheduled does
    not keep the others' names away). Made earlier, its Endpoints and EndpointSlices would follow
    every pod's IP and readiness while the pods start: about 110 more writes to the API server
    for a 32-pod role, on the same CPUs as the kubelets starting the pods. Nothing of ours needs
    it sooner: pods get their peers' addresses from the registry (the environment), and their
    own resolver is the node's (``dnsPolicy: Default``), not the cluster's DNS, so no pod of the
    job can cache a name's absence; the earliest a peer's DNS name can answer is when that
    peer has an IP anyway."""

    since: float
    creating: int = 0  # pods of the role still being created
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # pod name -> its manifest as created


SERVICE_WAIT_SECONDS = 30.0


class KubernetesBackend(Backend):
    name = "kubernetes"
    running_at_start = False  # a pod runs once scheduled and its container started
    runs_containers = True
    instance_channel = "tcp"  # pods reach the controller by address (report, publish)

    def __init__(
        self,
        options: KubernetesOptions | None = None,
        owner_of: Callable[[LaunchSpec], k8s.Owner | None] | None = None,
    ):
        from kubernetes import client

        self.options = options or KubernetesOptions()
        kubeconfig = self.options.kubeconfig or default_kubeconfig()
        self.api = api_client(kubeconfig, self.options.context)
        # plain dicts in and out (the API's JSON): bodies are validated by the client, answers
        # read raw (``_preload_content=False``): no model objects on the hot path
        self.core: Any = client.CoreV1Api(self.api)
        self.namespace = self.options.namespace
        self.names = k8s.PodNames(self.options.pod_names)
        self._owner_of = owner_of
        self.host = self._host_runtime(kubeconfig)
        self._lock = threading.RLock()
        self._held: dict[str, _Held] = {}  # instance id -> its wait step
        self._where: dict[str, tuple[str, str]] = {}  # instance id -> (namespace, pod name)
        self._creating: dict[str, Future[None]] = {}
        self._refused: dict[str, Observation] = {}  # starts the API refused
        self._ended: dict[str, Observation] = {}  # final observations of pods gone
        self._stopping: dict[str, tuple[str, str, float]] = {}  # instance id -> (namespace, pod, confirm at)
        self._followers: dict[str, threading.Thread] = {}  # pod uid -> log follower
        self._log_paths: dict[str, str] = {}  # instance id -> log file
        self._services: set[str] = set()  # "<namespace>/<Service>" made (or being made)
        self._role_services: dict[str, _RoleService] = {}  # the same, not made yet
        self._anchors: dict[str, k8s.Owner] = {}  # job uid -> its ConfigMap (no owner_of)
        self._job_uids: dict[int, str] = {}
        self._ports_held: set[int] = set()
        self._next_port = FIRST_PORT
        self._wakes: list[Callable[[], None]] = []
        self._channel_checked = False
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(self.options.create_threads, thread_name_prefix="k8s-create")
        self._deleter = ThreadPoolExecutor(self.options.create_threads, thread_name_prefix="k8s-delete")
        # the operator's leader election: every write asks it first (a deposed leader writes nothing)
        self.fence: Callable[[], None] = lambda: None
        selector = f"{k8s.MANAGED_BY}={k8s.MANAGER}"
        if self.namespace:
            self.pods = WatchedCache(
                self.api,
                self.core.list_namespaced_pod,
                "pods",
                self._pod_changed,
                namespace=self.namespace,
                label_selector=selector,
            )
        else:
            self.pods = WatchedCache(
                self.api, self.core.list_pod_for_all_namespaces, "pods", self._pod_changed, label_selector=selector
            )
        self.nodes = WatchedCache(self.api, self.core.list_node, "nodes", self._node_changed)
        if not (self.pods.wait_synced(SYNC_TIMEOUT) and self.nodes.wait_synced(SYNC_TIMEOUT)):
            self.close()
            raise UserError(
                f"the Kubernetes API at {self.api.configuration.host} did not answer within {SYNC_TIMEOUT:.0f} s "
                "(list pods and nodes); is the cluster up (`trainmaster cluster status`)?"
            )
        self._gates = threading.Thread(target=self._gate_loop, name="k8s-gates", daemon=True)
        self._gates.start()

    def _host_runtime(self, kubeconfig: str | None) -> k8s.HostRuntime | None:
        wanted = self.options.host_runtime
        if wanted is None:
            ours = kubeconfig is not None and Path(kubeconfig).resolve().is_relative_to(state_root().resolve())
            wanted = ours or os.environ.get(HOST_RUNTIME_ENV) == "1"
        if not wanted:
            return None
        return k8s.HostRuntime(images.PYTHON, images.python_executable(), tuple(images.host_runtime_mounts()))

    # ---- capacity and placement ------------------------------------------------------------------
    def capacity(self) -> Resources:
        return k8s.total_capacity(self.nodes.items())

    def place(self, request: PlacementRequest) -> Placement:
        """The pod's IP is its host (known once it runs: ``$(TM_POD_IP)`` until then); ports are
        the pod's own, so the declared ones are always free; others are distinct per live
        instance, which keeps addresses readable."""
        wanted = request.wanted_ports
        with self._lock:
            chosen = [wanted[i] if i < len(wanted) else self._take_port() for i in range(request.ports)]
        return Placement(k8s.POD_IP, chosen)

    def _take_port(self) -> int:
        for _ in range(LAST_PORT - FIRST_PORT):
            port = self._next_port
            self._next_port = FIRST_PORT if port + 1 >= LAST_PORT else port + 1
            if port not in self._ports_held:
                self._ports_held.add(port)
                return port
        raise RuntimeError("no port left to hand out")

    def release(self, placement: Placement) -> None:
        with self._lock:
            self._ports_held.difference_update(placement.ports)

    def reserve_gang(self, job_id: int, bundles: list[Resources]) -> GangReservation:
        """Admission against the nodes' allocatable minus every bound pod's requests (all
        namespaces: other tenants' pods take room too). A check, not a reservation: the
        default scheduler places the pods, and a pod that no longer fits shows Unschedulable."""
        if all(b.cpu <= 0 and b.memory <= 0 and b.gpu <= 0 for b in bundles):
            return GangReservation(True)  # nothing requested: any Ready node holds it (no LIST)
        answer = self.core.list_pod_for_all_namespaces(
            field_selector="status.phase!=Succeeded,status.phase!=Failed", _preload_content=False
        )
        pods = json.loads(answer.data).get("items", [])
        fits, why = k8s.gang_fits(k8s.free_rooms(self.nodes.items(), pods), bundles)
        return GangReservation(fits, why)

    def release_gang(self, job_id: int) -> None:
        """The job ended: with ``cleanup``, delete its object (its pods and services follow)."""
        uid = self._job_uids.pop(job_id, None)
        if not self.options.cleanup or uid is None:
            return
        anchor = self._anchors.pop(uid, None)
        if anchor is not None:
            self._delete_quietly(
                lambda: self.core.delete_namespaced_config_map(
                    anchor.name, anchor.namespace, propagation_policy="Background"
                )
            )

    # ---- start ---------------------------------------------------------------------------------
    def namespace_of(self, spec: LaunchSpec) -> str:
        owner = self._owner_of(spec) if self._owner_of is not None else None
        return (owner.namespace if owner is not None else "") or self.namespace or "default"

    def _handle(self, spec: LaunchSpec) -> InstanceHandle:
        return InstanceHandle(NODE, spec.instance_id, None, list(spec.ports), spec.instance_dir)

    def start(self, requests: list[LaunchRequest]) -> Iterator[InstanceHandle | StartFailure]:
        """Every handle at once; pods are created by the pool (a dependent one of its own image
        once its dependencies hold), the start's first one here when it can be
        (:meth:`_create_here`). A refusal by the API shows as an exit with reason StartFailed."""
        lead: Future[None] | None = None  # the start's first pod: the others follow it
        for request in requests:
            spec = request.spec
            if spec.container is None and self.host is None:
                yield StartFailure(
                    f"role {spec.role} has no image; this cluster's nodes are not this machine, so give the role "
                    "an image (spec.roles[].image)"
                )
                continue
            with self._lock:
                self._job_uids[spec.job_id] = k8s.job_uid(spec)
                self._log_paths[spec.instance_id] = spec.log_path
                self._where[spec.instance_id] = (self.namespace_of(spec), self.names.pod(spec))
                in_pod = spec.container is None
                if spec.depends:
                    if in_pod:  # an earlier attempt's environment file, gone before this attempt's gate writes
                        Path(spec.instance_dir, k8s.ENV_FILE).unlink(missing_ok=True)
                    self._held[spec.instance_id] = _Held(spec, time.monotonic(), in_pod)
                    if not in_pod:  # a new controller's backend finds it in its folder and holds it again
                        _write_private(Path(spec.instance_dir, HELD_RECORD), spec.to_dict())
            if in_pod or not spec.depends:  # (not under the lock: the watch's callbacks take it)
                created = (self._create_here(spec) if lead is None else None) or self._submit(spec, {}, lead)
                lead = lead or created
            yield self._handle(spec)
        self._release_gates()

    def _submit(
        self, spec: LaunchSpec, services: dict[str, list[str]], lead: Future[None] | None = None
    ) -> Future[None]:
        """Create ``spec``'s pod in the pool; with ``lead`` (the first pod of the same start),
        once that one is answered (:data:`LEAD_WAIT_SECONDS` at most). Returns the creation."""
        key = f"{self.namespace_of(spec)}/{self.names.service(spec)}"
        with self._lock:
            if key not in self._services:
                self._role_services.setdefault(key, _RoleService(time.monotonic())).creating += 1
            if lead is None:
                creating = self._pool.submit(self._create, spec, services)
            else:
                creating = self._pool.submit(self._create_after, lead, spec, services)
            self._creating[spec.instance_id] = creating
        return creating

    def _create_here(self, spec: LaunchSpec) -> Future[None] | None:
        """A start's first pod, created on the caller's thread (the controller's pass) when
        nothing can hold its create: a first attempt with no pod of that name in the cluster.
        Handed to the pool instead, it would wait for a pool thread to wake and then share the
        interpreter with the rest of the pass (measured on a loaded machine: 0.5 to 12 ms before
        the request left); the others of the start are sent once it is answered. None where it
        goes to the pool (a later attempt may wait for its predecessor's pod to go)."""
        namespace, name = self.namespace_of(spec), self.names.pod(spec)
        if spec.attempt != 1 or self.pods.get(namespace, name) is not None:
            return None
        key = f"{namespace}/{self.names.service(spec)}"
        done: Future[None] = Future()
        with self._lock:
            if key not in self._services:
                self._role_services.setdefault(key, _RoleService(time.monotonic())).creating += 1
            self._creating[spec.instance_id] = done
        try:
            self._create(spec, {})
        finally:
            done.set_result(None)
        return done

    def _create_after(self, lead: Future[None], spec: LaunchSpec, services: dict[str, list[str]]) -> None:
        """A start's first pod goes to the API alone, the rest once it is answered (at most
        ``LEAD_WAIT_SECONDS`` later). Sent together, the first pod's create shares this process
        and the API server with all the others (measured with 8: answered after ~35 ms instead
        of ~10 ms), so the node gets its first pod, and begins the gang's sandboxes, later; the
        others follow a few milliseconds after it. The kubelets of ``trainmaster cluster up`` run
        at current Kubernetes' API client limits (50 requests per second, bursts of 100; 1.20's
        default was 5 per second), so their status reports no longer queue behind a rate limit
        and this ordering only moves the first pod's start, not the gang's status reports."""
        futures.wait([lead], timeout=LEAD_WAIT_SECONDS)
        self._create(spec, services)

    def wait_created(self, timeout: float) -> None:
        """Until every pod being created has been answered by the API (``timeout`` at most)."""
        with self._lock:
            pending = [f for f in self._creating.values() if not f.done()]
        if pending:
            futures.wait(pending, timeout=timeout)

    def _create(self, spec: LaunchSpec, services: dict[str, list[str]]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            if spec.depends and spec.container is None:  # waits in the pod: its environment comes in the file
                env = {**k8s.base_environment(spec), "PATH": self._path(spec.env.get("PATH"))}
                # (an earlier attempt's environment file was removed by start(): removed here, in the
                # pool, it could go after this attempt's gate wrote the new one, and the pod would
                # wait for it until its dependency timeout)
                os.makedirs(spec.instance_dir, exist_ok=True)
            else:
                env = self._environment(spec, services)
            name = self.names.pod(spec)
            namespace = self.namespace_of(spec)
            owner = self._owner(spec, namespace)
            service = self.names.service(spec)
            self._remove_predecessor(spec, namespace, name)
            body = k8s.pod_manifest(spec, env, name, namespace, service, self.host, owner)
            self.fence()
            try:
                answer = self.core.create_namespaced_pod(
                    namespace, body, _preload_content=False, _request_timeout=CREATE_TIMEOUT
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
                existing = self._read_pod(namespace, name)
                if existing is None or _instance(existing) != spec.instance_id:
                    raise RuntimeError(
                        f"a pod named {name} of another instance exists in namespace {namespace} "
                        f"({_instance(existing) if existing else 'unknown'}); delete it or rename the job"
                    ) from None
                made = existing
            else:
                made = json.loads(answer.data)
            self.pods.put(made)
        except ApiException as exc:
            self._refuse(spec, f"the API refused the pod: {_api_message(exc)}")
        except Exception as exc:  # a bad manifest, an unreachable API: the attempt fails readably
            self._refuse(spec, f"could not create the pod: {exc}")
        else:
            self._want_service(made)
        finally:
            with self._lock:
                role = self._role_services.get(f"{self.namespace_of(spec)}/{self.names.service(spec)}")
                if role is not None:
                    role.creating -= 1
            self._release_services()

    def _environment(self, spec: LaunchSpec, services: dict[str, list[str]]) -> dict[str, str]:
        """The instance's variables (one resolver: :func:`instance_environment`) without the
        controller's own environment; this machine's software finds the venv's programs first."""
        inputs = spec.env_inputs
        env = (
            instance_environment({**inputs, "env": k8s.base_environment(spec)}, services) if inputs else dict(spec.env)
        )
        if spec.container is None:
            env["PATH"] = self._path(env.get("PATH"))
        self._check_channel(env.get("TM_CHANNEL", ""))
        return env

    def _check_channel(self, url: str) -> None:
        """Pods reach the controller's instance channel by address: a loopback one is the pod's
        own, so say once that ``report()`` and ``publish()`` in pods will reach nobody."""
        host = urlsplit(url).hostname or ""
        if self._channel_checked or not url.startswith("http"):
            return
        self._channel_checked = True
        if host == "localhost" or host.startswith("127.") or host == "::1":
            log.warning(
                "the instance channel is at %s, which pods cannot reach (a loopback address: this machine "
                "has no default route); set TRAINMASTER_CHANNEL_HOST to an address of this machine that the "
                "cluster's pods reach, or report() and publish() in pods store nothing",
                url,
            )

    def _path(self, path: str | None) -> str:
        """``PATH`` of a pod of this machine's software: the venv's programs first (torchrun)."""
        venv = os.path.dirname(self.host.python) if self.host is not None else ""
        return os.pathsep.join(p for p in (venv, path or "/usr/bin:/bin") if p)

    def _refuse(self, spec: LaunchSpec, message: str) -> None:
        with self._lock:
            self._refused[spec.instance_id] = Observation(
                Phase.EXITED, exit_code=127, reason=k8s.START_FAILED, message=message
            )
        self._wake()

    def _owner(self, spec: LaunchSpec, namespace: str) -> k8s.Owner | None:
        if self._owner_of is not None:
            return self._owner_of(spec)
        uid = k8s.job_uid(spec)
        with self._lock:
            known = self._anchors.get(uid)
        if known is not None:
            return known
        from kubernetes.client.exceptions import ApiException

        name = k8s.dns_label(f"{spec.job_name}-{k8s.short_hash(uid)}")
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {
                    k8s.MANAGED_BY: k8s.MANAGER,
                    k8s.LABEL_JOB: k8s.label_value(spec.job_name),
                    k8s.LABEL_JOB_UID: k8s.label_value(uid),
                },
            },
            "data": {"job": spec.job_name, "uid": uid, "about": "Trainmaster's job; deleting it deletes its pods"},
        }
        try:
            created = json.loads(self.core.create_namespaced_config_map(namespace, body, _preload_content=False).data)
        except ApiException as exc:
            if exc.status != 409:
                raise
            created = json.loads(self.core.read_namespaced_config_map(name, namespace, _preload_content=False).data)
        owner = k8s.Owner("v1", "ConfigMap", name, created["metadata"]["uid"], namespace=namespace)
        with self._lock:
            self._anchors[uid] = owner
        return owner

    # ---- a role's Service, once its pods have IPs ---------------------------------------------------
    def _want_service(self, pod: dict[str, Any]) -> None:
        """The Service of ``pod``'s role is needed (made by :meth:`_release_services`)."""
        key = k8s.service_key(pod)
        if key is None:
            return
        with self._lock:
            if key not in self._services:
                role = self._role_services.setdefault(key, _RoleService(time.monotonic()))
                role.pods[pod["metadata"]["name"]] = pod

    def _release_services(self) -> None:
        """Make each Service whose role's pods all have IPs (or that waited long enough)."""
        if not self._role_services:
            return
        ready: list[tuple[str, dict[str, Any]]] = []
        with self._lock:
            for key, role in list(self._role_services.items()):
                if not role.pods:
                    if role.creating <= 0:  # every creation failed: nothing to serve
                        del self._role_services[key]
                    continue
                namespace = key.split("/", 1)[0]
                if role.creating <= 0 and all(self.pods.get(namespace, name) is None for name in role.pods):
                    del self._role_services[key]  # every pod of the role is gone already: no Service
                    continue
                waited = time.monotonic() - role.since >= SERVICE_WAIT_SECONDS
                if waited or (role.creating <= 0 and all(self._has_ip(namespace, name) for name in role.pods)):
                    del self._role_services[key]
                    self._services.add(key)
                    ready.append((key, next(iter(role.pods.values()))))
        for key, pod in ready:
            self._pool.submit(self._make_service, key, pod)

    def _has_ip(self, namespace: str, name: str) -> bool:
        pod = self.pods.get(namespace, name)
        return pod is None or bool((pod.get("status") or {}).get("podIP"))  # gone: nothing to wait for

    def _make_service(self, key: str, pod: dict[str, Any]) -> None:
        """The role's headless Service (once per role; AlreadyExists is fine: another attempt's
        or an earlier controller's)."""
        from kubernetes.client.exceptions import ApiException

        namespace = key.split("/", 1)[0]
        try:
            self.fence()
            settle(self.core.create_namespaced_service(namespace, k8s.service_manifest(pod), _preload_content=False))
        except ApiException as exc:
            if exc.status != 409:
                self._services.discard(key)  # the next attempt of the role tries again
                log.warning("the Service %s: %s", key, _api_message(exc))
        except Exception as exc:
            self._services.discard(key)
            log.warning("the Service %s: %s", key, exc)

    def _remove_predecessor(self, spec: LaunchSpec, namespace: str, name: str) -> None:
        """Every earlier attempt's pod of this instance (the same name, or the same job, role and
        index) is gone before the next is created: one pod per instance, so no instance ever
        runs twice. One being stopped keeps its grace period; any other is deleted with grace 0."""
        uid, role, index = k8s.label_value(k8s.job_uid(spec)), k8s.label_value(spec.role), str(spec.index)
        earlier = {
            (str(p["metadata"].get("namespace") or namespace), str(p["metadata"]["name"])): p
            for p in self.pods.items()
            if _instance(p) != spec.instance_id
            and (
                (p["metadata"]["name"] == name and p["metadata"].get("namespace", namespace) == namespace)
                or (
                    (labels := p["metadata"].get("labels") or {}).get(k8s.LABEL_JOB_UID) == uid
                    and labels.get(k8s.LABEL_ROLE) == role
                    and labels.get(k8s.LABEL_INDEX) == index
                )
            )
        }
        if (namespace, name) not in earlier and spec.attempt > 1:  # the watch may lag: ask the API
            pod = self._read_pod(namespace, name)
            if pod is not None and _instance(pod) != spec.instance_id:
                earlier[(namespace, name)] = pod
        if not earlier:
            return
        for (ns, pod_name), pod in earlier.items():
            if not pod["metadata"].get("deletionTimestamp"):
                self._delete_pod(ns, pod_name, 0)

        def gone() -> bool:
            return all(
                (p := self._read_pod(ns, pod_name)) is None or _instance(p) == spec.instance_id
                for ns, pod_name in earlier
            )

        limit = DELETE_TIMEOUT + max(
            int(p["metadata"].get("deletionGracePeriodSeconds") or 0) for p in earlier.values()
        )
        if not wait_until(gone, limit, 0.1):
            raise RuntimeError(
                f"the pod(s) {', '.join(n for _, n in earlier)} of an earlier attempt were not gone after {limit:.0f} s"
            )

    def _read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(json.loads(self.core.read_namespaced_pod(name, namespace, _preload_content=False).data))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # ---- dependencies: the wait step, judged from the watched pods --------------------------------
    def _release_gates(self) -> None:
        """Let held instances whose dependencies now hold go on (write the environment file a
        waiting pod reads, or create the pod); time out the rest."""
        with self._lock:
            held = list(self._held.values())
        for gate in held:
            services, waiting = self._dependencies(gate.spec)
            timed_out = services is None and time.monotonic() - gate.since >= waiting[0][1].timeout
            if services is None and not timed_out:
                continue
            with self._lock:
                if self._held.pop(gate.spec.instance_id, None) is None:
                    continue  # stopped meanwhile
            if not gate.in_pod:
                Path(gate.spec.instance_dir, HELD_RECORD).unlink(missing_ok=True)
            if gate.in_pod:
                self._write_environment(gate.spec, services, waiting[0][0] if timed_out else "")
            elif services is not None:
                self._submit(gate.spec, services)
            else:
                with self._lock:
                    self._refused[gate.spec.instance_id] = Observation(
                        Phase.EXITED, exit_code=124, reason="DependencyTimeout", message=waiting[0][0]
                    )
            self._wake()

    def _write_environment(self, spec: LaunchSpec, services: dict[str, list[str]] | None, failure: str) -> None:
        """The environment file of a pod in its wait step: its whole environment once its
        dependencies hold (resolved with their addresses), or why it gives up."""
        if failure:
            content: dict[str, Any] = {"reason": "DependencyTimeout", "message": failure}
        else:
            env = self._environment(spec, services or {})
            content = {"env": {k: v for k, v in env.items() if k not in k8s.WITHHELD}}
        _write_private(Path(spec.instance_dir, k8s.ENV_FILE), content)

    def _dependencies(self, spec: LaunchSpec) -> tuple[dict[str, list[str]] | None, list[tuple[str, Any]]]:
        """Role -> addresses of every dependency when all hold, else None and what is missing."""
        uid = k8s.label_value(k8s.job_uid(spec))
        pods = [p for p in self.pods.items() if (p["metadata"].get("labels") or {}).get(k8s.LABEL_JOB_UID) == uid]
        services: dict[str, list[str]] = {}
        missing = []
        for dep in spec.depends:
            newest: dict[int, dict[str, Any]] = {}
            for pod in pods:
                lab = pod["metadata"].get("labels") or {}
                if lab.get(k8s.LABEL_ROLE) != k8s.label_value(dep.role):
                    continue
                index, attempt = int(lab.get(k8s.LABEL_INDEX, 0)), int(lab.get(k8s.LABEL_ATTEMPT, 0))
                if index not in newest or attempt > int(newest[index]["metadata"]["labels"][k8s.LABEL_ATTEMPT]):
                    newest[index] = pod
            ready = {}
            for index, pod in newest.items():
                obs = k8s.pod_observation(pod)
                if obs.phase == Phase.RUNNING and k8s.waiting(pod):  # its own wait step: placed, not running
                    obs = Observation(Phase.STARTING, host=obs.host, ports=obs.ports)
                ok = {
                    "Running": obs.phase == Phase.RUNNING or (obs.phase == Phase.EXITED and obs.exit_code == 0),
                    "Succeeded": obs.phase == Phase.EXITED and obs.exit_code == 0,
                    "Placed": bool(obs.host) and obs.phase != Phase.EXITED,
                }.get(dep.condition, False)
                if ok and obs.host:
                    ready[index] = f"{obs.host}:{obs.ports[0]}" if obs.ports else obs.host
            if len(ready) >= dep.replicas:
                services[dep.role] = [ready[i] for i in sorted(ready)]
            else:
                what = {"Running": "have an address", "Placed": "are placed"}.get(dep.condition, "have succeeded")
                missing.append(
                    (
                        f"waited {dep.timeout:g}s for role '{dep.role}' ({dep.condition}): "
                        f"{len(ready)} of {dep.replicas} instances {what}",
                        dep,
                    )
                )
        return (services if not missing else None), missing

    def _gate_loop(self) -> None:
        """Held instances also time out while nothing changes in the cluster; stops are
        confirmed; a role's Service waits no longer than ``SERVICE_WAIT_SECONDS``."""
        while not self._closing.wait(GATE_CHECK_SECONDS):
            try:
                if self._held:
                    self._release_gates()
                if self._stopping:
                    self._confirm_stops()
                if self._role_services:
                    self._release_services()
            except Exception:
                log.exception("checking held instances, stopped pods and role Services")

    # ---- observe --------------------------------------------------------------------------------
    def observe(self, handles: list[InstanceHandle]) -> list[Observation]:
        return [self._observe(h.instance_id) for h in handles]

    def _locate(self, iid: str) -> tuple[str, str] | None:
        """(namespace, pod name) of an attempt: from its start, else from the watched pods."""
        with self._lock:
            where = self._where.get(iid)
        if where is not None:
            return where
        for pod in self.pods.items():
            if _instance(pod) == iid:
                meta = pod["metadata"]
                found = (str(meta.get("namespace") or self.namespace), str(meta["name"]))
                with self._lock:
                    self._where[iid] = found
                return found
        return None

    def _observe(self, iid: str) -> Observation:
        waiting = Observation(Phase.STARTING, reason="WaitingForDependencies", message="in its dependency wait step")
        with self._lock:
            if iid in self._refused:
                return self._refused[iid]
            gate = self._held.get(iid)
            if gate is not None and not gate.in_pod:
                return waiting
            creating = self._creating.get(iid)
            ended = self._ended.get(iid)
        where = self._locate(iid)
        pod = self.pods.get(*where) if where else None
        if pod is not None and _instance(pod) == iid:
            obs = k8s.pod_observation(pod, self._node_ready(pod))
            if (gate is not None or k8s.waiting(pod)) and obs.phase in (Phase.STARTING, Phase.RUNNING):
                return Observation(
                    Phase.STARTING, reason=waiting.reason, message=waiting.message, host=obs.host, ports=obs.ports
                )
            if obs.phase == Phase.EXITED:
                self._complete_log(pod, iid)
            elif obs.phase == Phase.RUNNING:
                self._follow_log(pod, iid)
            elif obs.phase == Phase.LOST and obs.reason == "NodeLost" and iid not in self._stopping and where:
                with self._lock:
                    self._stopping[iid] = (where[0], where[1], time.monotonic() + STOP_CONFIRM_SECONDS)
                self._pool.submit(self._delete_pod, where[0], where[1], 0)
            return obs
        if gate is not None:
            return waiting
        if creating is not None and not creating.done():
            return Observation(Phase.STARTING, reason="Creating", message="its pod is being created")
        if ended is not None:
            return ended
        if creating is not None:  # created, not yet in the watched cache
            return Observation(Phase.STARTING, reason="Creating", message="its pod was just created")
        name = where[1] if where else "of this attempt"
        return Observation(Phase.LOST, reason="Deleted", message=f"its pod {name} no longer exists")

    def _node_ready(self, pod: dict[str, Any]) -> bool:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return True
        found = self.nodes.get("", node)
        return found is None or k8s.node_ready(found) or bool((found.get("spec") or {}).get("unschedulable"))

    def _pod_changed(self, kind: str, pod: dict[str, Any]) -> None:
        iid = _instance(pod)
        if kind == "DELETED" and iid:
            obs = k8s.pod_observation(pod)
            if obs.phase != Phase.EXITED:
                obs = Observation(Phase.EXITED, exit_code=137, reason="Stopped", message="its pod was deleted")
            else:
                self._complete_log(pod, iid)
            with self._lock:
                self._ended[iid] = obs  # until forgotten: an observe after the pod is gone still says how it ended
                while len(self._ended) > MAX_ENDED:
                    self._ended.pop(next(iter(self._ended)))
                self._stopping.pop(iid, None)
        if self._held:
            self._release_gates()
        if self._role_services and kind != "DELETED":
            self._release_services()
        self._wake()

    def _node_changed(self, kind: str, node: dict[str, Any]) -> None:
        self._wake()  # a node that went away makes its pods Lost: the controller should look now

    # ---- logs through the API --------------------------------------------------------------------
    def _follow_log(self, pod: dict[str, Any], iid: str) -> None:
        if not self.options.follow_logs:
            return
        uid = pod["metadata"].get("uid", "")
        annotations = pod["metadata"].get("annotations") or {}
        with self._lock:
            path = self._log_paths.get(iid) or annotations.get(k8s.ANNOTATION_LOG, "")
            if uid in self._followers or not path:
                return
            meta = pod["metadata"]
            thread = threading.Thread(
                target=self._stream_log,
                args=(meta.get("namespace", ""), meta["name"], path),
                name="k8s-log",
                daemon=True,
            )
            self._followers[uid] = thread
        thread.start()

    def _complete_log(self, pod: dict[str, Any], iid: str) -> None:
        """Before an exit is reported, its log is in the file (a pod that ran between two looks
        is read whole)."""
        self._follow_log(pod, iid)
        thread = self._followers.get(pod["metadata"].get("uid", ""))
        if thread is not None:
            thread.join(timeout=10.0)

    def _stream_log(self, namespace: str, name: str, path: str) -> None:
        try:
            answer = self.core.read_namespaced_pod_log(
                name, namespace, container=k8s.CONTAINER, follow=True, _preload_content=False
            )
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as out:
                for chunk in answer.stream(amt=None):
                    out.write(chunk)
                    out.flush()
            answer.release_conn()
        except Exception as exc:  # the pod went away first: what was written stays
            log.debug("log of pod %s: %s", name, exc)

    # ---- stop ----------------------------------------------------------------------------------
    def stop(self, handles: list[InstanceHandle], grace: float) -> None:
        """Delete each pod with ``grace`` seconds to end (the kubelet sends SIGTERM, then SIGKILL)
        and return once the API server has accepted every deletion, not once the pods are gone,
        so a controller's pass never waits on kubelets. That is safe here because:

        - the intent is recorded in the cluster (the pod's ``deletionTimestamp``): a controller
          killed now leaves nothing to redo, the kubelet ends the pod anyway;
        - it is confirmed later: a pod still there ``STOP_CONFIRM_SECONDS`` past its grace is
          deleted again with grace 0 (:meth:`_confirm_stops`, on the backend's own thread);
        - no later attempt of the same instance gets a pod while an earlier attempt's pod exists
          (:meth:`_remove_predecessor` waits for it, in the creating thread), so an instance
          never runs twice."""
        doomed: list[tuple[str, str]] = []
        # at least 1 s: a grace of 0 deletes the object at once, before the kubelet stopped anything
        seconds = max(1, math.ceil(grace))
        for handle in handles:
            iid = handle.instance_id
            with self._lock:
                gate = self._held.pop(iid, None)
                creating = self._creating.get(iid)
            if gate is not None and not gate.in_pod:
                Path(gate.spec.instance_dir, HELD_RECORD).unlink(missing_ok=True)
                with self._lock:
                    self._ended[iid] = Observation(
                        Phase.EXITED, exit_code=137, reason="Stopped", message="stopped in its wait step"
                    )
                continue
            if creating is not None:
                creating.result(timeout=DELETE_TIMEOUT)
            where = self._locate(iid)
            if where is None:
                continue
            with self._lock:
                self._stopping[iid] = (where[0], where[1], time.monotonic() + seconds + STOP_CONFIRM_SECONDS)
            doomed.append(where)
        # every deletion at once (one request each), answered before the pass goes on
        for done in [self._deleter.submit(self._delete_pod, ns, name, seconds) for ns, name in doomed]:
            done.result(timeout=DELETE_TIMEOUT)

    def _confirm_stops(self) -> None:
        """Pods still there well past their grace (a kubelet that missed the deletion, a node
        gone): deleted again, with grace 0."""
        now = time.monotonic()
        with self._lock:
            late = [(iid, ns, name) for iid, (ns, name, due) in self._stopping.items() if due <= now]
            for iid, ns, name in late:
                self._stopping[iid] = (ns, name, now + STOP_CONFIRM_SECONDS)
        for iid, ns, name in late:
            pod = self.pods.get(ns, name)
            if pod is None or _instance(pod) != iid:
                with self._lock:
                    self._stopping.pop(iid, None)
                continue
            log.info("pod %s/%s outlived its grace period; deleting it with grace 0", ns, name)
            self._delete_pod(ns, name, 0)

    def _delete_pod(self, namespace: str, name: str, grace: int) -> None:
        self.fence()
        self._delete_quietly(
            lambda: settle(
                self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=grace, _preload_content=False)
            )
        )

    @staticmethod
    def _delete_quietly(call: Callable[[], Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            call()
        except ApiException as exc:
            if exc.status != 404:
                raise

    def forget(self, handles: list[InstanceHandle]) -> None:
        with self._lock:
            for handle in handles:
                iid = handle.instance_id
                for table in (self._ended, self._refused, self._creating, self._where, self._log_paths):
                    table.pop(iid, None)  # type: ignore[attr-defined]

    # ---- a new controller ---------------------------------------------------------------------
    def adopt(self, handle: InstanceHandle) -> bool:
        """A live pod of this attempt (one still in its wait step is this backend's to let go on),
        or a dependent one of its own image still held (its spec is in its folder)."""
        iid = handle.instance_id
        with self._lock:
            self._ports_held.update(handle.ports)
        where = self._locate(iid)
        pod = self.pods.get(*where) if where else None
        if pod is not None and _instance(pod) == iid:
            # an earlier controller may have ended before making the role's Service
            self._want_service(pod)
            launch = (pod["metadata"].get("annotations") or {}).get(k8s.ANNOTATION_LAUNCH)
            if launch and k8s.waiting(pod):
                spec = LaunchSpec.from_dict(json.loads(launch))
                with self._lock:
                    self._held.setdefault(iid, _Held(spec, time.monotonic(), in_pod=True))
            return self._observe(iid).phase in (Phase.STARTING, Phase.RUNNING)
        record = Path(handle.instance_dir, HELD_RECORD) if handle.instance_dir else None
        if record is not None and record.exists():
            spec = LaunchSpec.from_dict(json.loads(record.read_text()))
            with self._lock:
                self._held[iid] = _Held(spec, time.monotonic())
                self._job_uids[spec.job_id] = k8s.job_uid(spec)
                self._where[iid] = (self.namespace_of(spec), self.names.pod(spec))
            return True
        return False

    def recover(self, instance_id: str, instance_dir: str) -> InstanceHandle | None:
        """The pod of ``instance_id`` (its annotation), or its held spec in ``instance_dir``."""
        for pod in self.pods.items():
            if _instance(pod) == instance_id:
                meta = pod["metadata"]
                ports = json.loads((meta.get("annotations") or {}).get(k8s.ANNOTATION_PORTS, "[]"))
                return InstanceHandle(NODE, instance_id, _recorded_pid(instance_dir), ports, instance_dir)
        record = Path(instance_dir, HELD_RECORD)
        if record.exists():
            spec = LaunchSpec.from_dict(json.loads(record.read_text()))
            return self._handle(spec) if spec.instance_id == instance_id else None
        return None

    # ---- exits wake the controller ----------------------------------------------------------------
    def watch_exits(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake not in self._wakes:
                self._wakes.append(wake)

    def _wake(self) -> None:
        for wake in list(self._wakes):
            wake()

    @property
    def requests(self) -> int:
        """API requests this backend made (each watch stream counts once)."""
        return int(self.api.requests)

    def close(self) -> None:
        self._closing.set()
        self.pods.close()
        self.nodes.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._deleter.shutdown(wait=False, cancel_futures=True)


HELD_RECORD = "pod-held.json"  # the LaunchSpec of an instance whose pod waits to be created


def _write_private(path: Path, content: dict[str, Any]) -> None:
    """A JSON file only root reads (an environment may hold secrets), replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
    os.replace(tmp, path)


def _recorded_pid(instance_dir: str) -> int | None:
    """The pid the host-runtime entry recorded (the machine's: the pod shares its PID namespace)."""
    try:
        return int(json.loads(Path(instance_dir, k8s.ATTEMPT_RECORD).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _instance(pod: dict[str, Any] | None) -> str:
    return str(((pod or {}).get("metadata") or {}).get("annotations", {}).get(k8s.ANNOTATION_INSTANCE, ""))


def _api_message(exc: Any) -> str:
    try:
        return str(json.loads(exc.body).get("message") or exc.reason)
    except (ValueError, TypeError, AttributeError):
        return str(exc.reason)
