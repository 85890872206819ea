"""The operator: jobs are custom resources; the cluster is the state of record.

``trainmaster operator`` (out of the cluster, or as the Deployment of ``trainmaster cluster
manifests``) installs the CRDs (:mod:`trainmaster.operator.kinds`), elects a leader on a Lease
(:mod:`trainmaster.operator.leader`), and the leader runs the same controller as ``trainmaster
run`` over the Kubernetes backend:

- **State of record**: the custom resources and their pods. The controller's store is a
  throwaway cache: a SQLite file in a temporary folder made when this process starts to lead,
  filled from the cluster (every resource not ended yet is submitted again under its own uid,
  and the newest pod of each instance is adopted: its attempt, address and phase are read back
  from its labels and status), and dropped when it stops leading. So a new leader carries on
  from what runs, and nothing is kept anywhere but in the cluster.
- **Submit**: a new resource is converted by the compat layer (Kubeflow, Volcano) or read as our
  own ``TrainingJob``, validated and queued. One that cannot run as written gets a Failed
  condition naming the field path, and the operator carries on with the others.
- **Status**: after every reconcile pass each job's status is written into its resource as its
  upstream operator writes it (:mod:`trainmaster.operator.status`), only when it changed.
- **Delete**: deleting a resource cancels its job; its pods and services are owned by it, so the
  garbage collector removes what is left.
- **Instance channel**: pods reach the leader (``report()``, ``publish()``, their wait step)
  at an address and with a token that outlive leadership: every leader serves the same port
  (derived from the API server's address and the Lease's name, ``TRAINMASTER_CHANNEL_PORT``
  overrides it) and signs tokens with a key kept in a Secret beside the Lease, so pods a killed
  leader started carry on reporting to the next one (they retry while no one serves).
"""

from __future__ import annotations

import base64
import gc
import json
import logging
import os
import queue
import re
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainmaster.backends import kubernetes_objects as k8s
from trainmaster.backends.kubernetes import KubernetesBackend, KubernetesOptions, api_client, default_kubeconfig, settle
from trainmaster.backends.kubernetes_watch import WatchedCache
from trainmaster.controller import Controller, metrics
from trainmaster.controller.channel import KEY_NAME, InstanceChannel, default_tcp_port
from trainmaster.loading import LoadOptions, load_document
from trainmaster.errors import UserError
from trainmaster.operator import status as statuses
from trainmaster.operator import trainjob
from trainmaster.operator.kinds import CRD_KINDS, KINDS, ResourceKind, crd_manifest
from trainmaster.operator.leader import Deposed, LeaseElector
from trainmaster.spec.model import RuntimeKind
from trainmaster.store import repository as repo
from trainmaster.store.db import make_engine, session_factory
from trainmaster.store.models import InstanceRow, KeyRow, utcnow

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 30.0
# seconds between reconcile passes that pod events (not resources) wake: Kubernetes' Job
# controller batches a job's pod updates the same way (``podUpdateBatchPeriod``, 1 s)
POD_PASS_GAP = 1.0
CRD_TIMEOUT = 60.0
CREATES_WAIT = 2.0  # the most a pass's status writes wait for its pod creates
KUBECTL_ANNOTATION = "kubectl.kubernetes.io/last-applied-configuration"


@dataclass(frozen=True)
class OperatorOptions:
    kubeconfig: str | None = None
    context: str | None = None
    identity: str = ""  # default: <host>-<pid>
    lease_namespace: str = "default"
    lease_name: str = "trainmaster-operator"
    lease_seconds: float = 8.0
    namespace: str = ""  # resources watched (and pods made) there; "" = every namespace
    runtime: RuntimeKind | None = None  # for roles with runtime auto (--runtime)
    interval: float = 1.0
    install_crds: bool = True
    host_runtime: bool | None = None
    metrics_port: int = 0  # serve Prometheus metrics on 127.0.0.1:<port> (0: none)
    # where a leader's throwaway cache and job folders go (None: the system's temporary folder);
    # with host-runtime pods it must be a folder of the machine (they mount their job folders)
    work_dir: str | None = None


@dataclass
class Tracked:
    """A resource this leader knows: its job in the cache (None: it cannot run, or it ended
    before this leader started) and the status last written."""

    kind: ResourceKind
    api_version: str
    namespace: str
    name: str
    uid: str
    job_id: int | None
    replica_types: list[str] = field(default_factory=list)
    min_available: int = 0
    written: dict[str, Any] | None = None
    deleted: bool = False
    stale: bool = True  # its status may differ from the one written: computed again after the next pass
    version: str = ""  # the resourceVersion a status write is conditioned on
    source_names: dict[str, str] = field(default_factory=dict)  # a role -> its name in the resource, where they differ


def to_document(kind: ResourceKind, obj: dict[str, Any]) -> dict[str, Any]:
    """The job document of a resource: as written by its user (what the API adds is left out)."""
    meta = obj.get("metadata") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k != KUBECTL_ANNOTATION}
    metadata: dict[str, Any] = {"name": meta.get("name")}
    if meta.get("labels"):
        metadata["labels"] = meta["labels"]
    if annotations:
        metadata["annotations"] = annotations
    if kind.status == "trainmaster":
        return {"apiVersion": "trainmaster/v1", "kind": "Job", "metadata": metadata, "spec": obj.get("spec")}
    return {"apiVersion": obj.get("apiVersion"), "kind": kind.kind, "metadata": metadata, "spec": obj.get("spec")}


ROLE_PATH = re.compile(r"^spec\.roles\[(\d+)\](?:\.(\w+))?(.*?)(: .*)$", re.S)


def source_path(kind: ResourceKind, obj: dict[str, Any], problem: str) -> str:
    """A problem of the converted job (``spec.roles[1].replicas: ...``) named by the field of the
    resource its user wrote (``spec.pytorchReplicaSpecs.Worker.replicas: ...``), the converted
    path kept in parentheses; unchanged where there is nothing to map."""
    if kind.status == "trainer":
        return trainjob.problem_text(obj, problem)
    match = ROLE_PATH.match(problem)
    if match is None or kind.status == "trainmaster":
        return problem
    index, field, rest, why = int(match.group(1)), match.group(2) or "", match.group(3), match.group(4)
    spec = obj.get("spec") or {}
    if kind.status == "kubeflow":
        key = next((k for k in spec if k.endswith("ReplicaSpecs")), "")
        types = replica_types(obj)
        if index >= len(types):
            return problem
        base = f"spec.{key}.{types[index]}"
    else:
        tasks = spec.get("tasks")
        if not isinstance(tasks, list):
            tasks = []
        if index >= len(tasks):
            return problem
        base = f"spec.tasks[{index}]"
    direct = {"replicas": "replicas", "restartPolicy": "restartPolicy"}
    where = f"{base}.{direct[field]}" if field in direct else f"{base}.template.spec.containers"
    return f"{where}{rest if field in direct else ''}{why} (spec.roles[{index}]{'.' + field if field else ''}{rest} once converted)"


def replica_types(obj: dict[str, Any]) -> list[str]:
    spec = obj.get("spec") or {}
    for key, value in spec.items() if isinstance(spec, dict) else []:
        if key.endswith("ReplicaSpecs") and isinstance(value, dict):
            return [str(k) for k in value]
    return []


class Operator:
    def __init__(self, options: OperatorOptions | None = None):
        from kubernetes import client

        self.options = options or OperatorOptions()
        self.kubeconfig = self.options.kubeconfig or default_kubeconfig()
        self.api = api_client(self.kubeconfig, self.options.context)
        self.custom: Any = client.CustomObjectsApi(self.api)
        self.identity = self.options.identity or f"{socket.gethostname()}-{os.getpid()}"
        self.elector = LeaseElector(
            self.api,
            self.options.lease_namespace,
            self.options.lease_name,
            self.identity,
            duration=self.options.lease_seconds,
        )
        self.leading = threading.Event()  # set while this process leads (tests and the bench read it)
        self._tracked: dict[str, Tracked] = {}
        self._events: queue.SimpleQueue[tuple[str, ResourceKind, dict[str, Any]]] = queue.SimpleQueue()
        self.backend: Any = None
        self.controller: Any = None
        self.channel: InstanceChannel | None = None
        self._past_requests = 0  # of backends of earlier terms as leader
        self._resource_event = threading.Event()  # a resource came or went: the next pass at once

    # ---- CRDs ------------------------------------------------------------------------------------
    def install_crds(self) -> None:
        """Create (or update) every CRD and wait until the API serves it."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        ext: Any = client.ApiextensionsV1Api(self.api)
        for kind in CRD_KINDS:
            body = crd_manifest(kind)
            try:
                settle(ext.create_custom_resource_definition(body, _preload_content=False))
            except ApiException as exc:
                if exc.status != 409:
                    raise
                current = json.loads(ext.read_custom_resource_definition(kind.crd_name, _preload_content=False).data)
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                settle(ext.replace_custom_resource_definition(kind.crd_name, body, _preload_content=False))
        deadline = time.monotonic() + CRD_TIMEOUT
        for kind in CRD_KINDS:
            while True:
                crd = json.loads(ext.read_custom_resource_definition(kind.crd_name, _preload_content=False).data)
                conditions = (crd.get("status") or {}).get("conditions") or []
                if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the CRD {kind.crd_name} was not Established within {CRD_TIMEOUT:.0f} s")
                time.sleep(0.1)

    # ---- the loop ---------------------------------------------------------------------------------
    def serve_metrics(self, port: int) -> None:
        """Prometheus metrics on 127.0.0.1:``port``: the controller's, ``trainmaster_leading``,
        ``trainmaster_operator_api_requests_total`` (every request to the API server, the
        backend's included; a watch counts once) and the process' own (RSS, CPU)."""
        from prometheus_client import ProcessCollector, start_http_server
        from prometheus_client.core import CounterMetricFamily

        operator = self

        class Requests:
            def collect(self) -> Any:
                family = CounterMetricFamily(
                    "trainmaster_operator_api_requests", "Requests this operator made to the Kubernetes API server"
                )
                family.add_metric([], operator.requests)
                yield family

        metrics.REGISTRY.register(Requests())  # type: ignore[arg-type]
        ProcessCollector(registry=metrics.REGISTRY)
        start_http_server(port, addr="127.0.0.1", registry=metrics.REGISTRY)

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop``: stand by, lead while holding the lease, stand by again if it is lost."""

        if self.options.metrics_port:
            self.serve_metrics(self.options.metrics_port)
        if self.options.install_crds:
            self.install_crds()
        while not stop.is_set():
            if not self.elector.acquire(stop):
                break
            metrics.LEADING.set(1)
            try:
                self._lead(stop)
            except Deposed as exc:
                log.warning("%s stops leading: %s", self.identity, exc)
            finally:
                metrics.LEADING.set(0)
                self.leading.clear()
                self._close_leader()
        self.elector.release()

    def _lead(self, stop: threading.Event) -> None:
        from kubernetes.client.exceptions import ApiException

        if self.options.work_dir:
            os.makedirs(self.options.work_dir, exist_ok=True)
        folder = tempfile.mkdtemp(prefix="tm-operator-", dir=self.options.work_dir)
        self._folder = folder
        url = f"sqlite:///{folder}/cache.db"
        self.sessions = session_factory(make_engine(url))
        with self.sessions() as session:  # the tokens of pods earlier leaders started stay good
            session.add(KeyRow(name=KEY_NAME, value=self._channel_key()))
            session.commit()
        # the same port for every replica of this operator (one cluster, one Lease), another for
        # an operator of another cluster on the same machine
        where = f"{self.api.configuration.host}/{self.options.lease_namespace}/{self.options.lease_name}"
        self.channel = InstanceChannel(self.sessions, url, tcp_port=default_tcp_port(where))
        self.backend = KubernetesBackend(
            KubernetesOptions(
                kubeconfig=self.kubeconfig,
                context=self.options.context,
                namespace=self.options.namespace,
                host_runtime=self.options.host_runtime,
                pod_names="kubeflow",
                cleanup=False,
                follow_logs=False,
            ),
            owner_of=self._owner_of,
        )
        self.backend.fence = self.elector.check
        self.controller = Controller(
            self.sessions,
            self.backend,
            url,
            interval=self.options.interval,
            runs_dir=Path(folder) / "runs",
            owner="operator",
            channel=self.channel,
        )
        self.backend.watch_exits(self.controller.wake)
        self._tracked, self._events = {}, queue.SimpleQueue()
        self._watches = []
        for kind in KINDS:
            for version in kind.versions[:1]:
                args: dict[str, Any] = {"group": kind.group, "version": version, "plural": kind.plural}
                call = self.custom.list_cluster_custom_object
                if self.options.namespace:
                    call, args = (
                        self.custom.list_namespaced_custom_object,
                        {**args, "namespace": self.options.namespace},
                    )
                self._watches.append(WatchedCache(self.api, call, kind.plural, self._handler(kind), **args))
        for watch in self._watches:
            if not watch.wait_synced(SYNC_TIMEOUT):
                raise RuntimeError(f"could not list the custom resources {watch._what} (is the CRD installed?)")
        # what this term's start made or imported (the Kubernetes client's and the ORM's modules
        # and classes, the watched objects: well over 100,000 objects) lives as long as the term:
        # kept out of every later full garbage collection, each of which would scan it all again
        # (sampled on a 32-pod start: most of the operator's CPU went to collections that the
        # ORM rows of a reconcile pass set off). Collected first, so only what lives is kept; a
        # later term freezes what it makes in turn.
        gc.collect()
        gc.freeze()
        self.leading.set()
        log.info("%s leads: %d resource(s) to take up", self.identity, self._events.qsize())
        while not stop.is_set():
            self.elector.check()
            self._take_events()
            self.controller.step()
            # the pass's pod creates first, then the statuses (as Kubernetes' Job controller
            # writes a Job's status once its creates are answered): a status write beside them
            # holds this process and the API server while a gang's first pod is on its way
            self.backend.wait_created(CREATES_WAIT)
            try:
                self._write_statuses()
            except ApiException as exc:
                log.info("writing status: %s", exc.reason)
            self._pace(time.monotonic())

    def _pace(self, passed: float) -> None:
        """Wait for the next pass: until woken (a resource event, a pod event, a submit) or the
        interval. Pod events come in bursts (each pod of a gang changes several times while it
        starts, as the kubelets report them one by one): a pass they wake waits until
        ``POD_PASS_GAP`` after the last, so one pass takes a second's worth of them, and the
        kubelets starting those pods keep the CPU. Measured on a 32-pod start: a pass every
        0.2 s cost the operator about as much CPU as the kubelet. A resource's event (a new job,
        a deletion) never waits, so a new job's pods are asked for at once."""
        self.controller.wait_for_work(self.options.interval)
        if not self._resource_event.is_set():
            self._resource_event.wait(max(0.0, passed + POD_PASS_GAP - time.monotonic()))
        self._resource_event.clear()

    def _close_leader(self) -> None:
        import shutil

        for watch in getattr(self, "_watches", []):
            watch.close()
        if self.backend is not None:
            self._past_requests += int(self.backend.requests)
            self.backend.close()
        if self.channel is not None:
            self.channel.close()  # its port is the next leader's (maybe this process' again)
        self.backend = self.controller = self.channel = None
        if getattr(self, "_folder", None):
            shutil.rmtree(self._folder, ignore_errors=True)

    def _channel_key(self) -> str:
        """The instance channel's signing key (hex), kept in the Secret ``<lease>-channel`` beside
        the Lease; the first leader creates it (two at once: the one that loses reads the other's)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        core: Any = client.CoreV1Api(self.api)
        ns, name = self.options.lease_namespace, f"{self.options.lease_name}-channel"

        def read() -> str | None:
            try:
                secret = json.loads(core.read_namespaced_secret(name, ns, _preload_content=False).data)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
            return base64.b64decode((secret.get("data") or {}).get("key", "")).decode() or None

        key = read()
        if key is not None:
            return key
        key = secrets.token_hex(32)
        body = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": ns, "labels": {k8s.MANAGED_BY: k8s.MANAGER}},
            "type": "Opaque",
            "data": {"key": base64.b64encode(key.encode()).decode()},
        }
        try:
            settle(core.create_namespaced_secret(ns, body, _preload_content=False))
        except ApiException as exc:
            if exc.status != 409:
                raise
            key = read() or ""
            if not key:
                raise RuntimeError(
                    f"the Secret {ns}/{name} holds no channel key; delete it to make a new one"
                ) from None
        return key

    def _handler(self, kind: ResourceKind) -> Callable[[str, dict[str, Any]], None]:
        """The watch's callback: the event is queued for the reconcile loop, which is woken."""

        def on_event(event: str, obj: dict[str, Any]) -> None:
            # a new resource or a deleted one: a pass now; a change of one already tracked (its
            # status, which this leader writes itself) only moves its version on
            uid = (obj.get("metadata") or {}).get("uid", "")
            self._events.put((event, kind, obj))  # queued before the flag: a pass the flag starts finds it
            if event == "DELETED" or uid not in self._tracked:
                self._resource_event.set()
            if self.controller is not None and self._resource_event.is_set():
                self.controller.wake()

        return on_event

    def _take_events(self) -> None:
        while True:
            try:
                event, kind, obj = self._events.get_nowait()
            except queue.Empty:
                return
            uid = (obj.get("metadata") or {}).get("uid", "")
            if event == "DELETED":
                self._deleted(uid)
            elif uid not in self._tracked:
                self._take_up(kind, obj)
            else:
                self._tracked[uid].version = _newer(self._tracked[uid].version, obj)

    # ---- a resource comes ---------------------------------------------------------------------------
    def _take_up(self, kind: ResourceKind, obj: dict[str, Any]) -> None:

        meta = obj.get("metadata") or {}
        tracked = Tracked(
            kind,
            str(obj.get("apiVersion") or kind.api_version),
            meta.get("namespace", ""),
            meta.get("name", ""),
            meta.get("uid", ""),
            None,
            replica_types(obj),
            written=obj.get("status") or None,
            version=str(meta.get("resourceVersion") or ""),
        )
        self._tracked[tracked.uid] = tracked
        if statuses.is_final(kind, obj.get("status")):
            return  # ended under an earlier leader: nothing to run, its status stays
        source = f"{kind.kind} {tracked.namespace}/{tracked.name}"
        try:
            options = LoadOptions(runtime=self.options.runtime)
            if kind.status == "trainer":  # the runtime it names, from the cluster
                options = LoadOptions(
                    runtime=self.options.runtime,
                    runtimes=trainjob.cluster_runtimes(self.custom, tracked.namespace, obj),
                )
            loaded = load_document(to_document(kind, obj), source=source, options=options)
        except UserError as exc:
            log.info("%s cannot run: %s", source, exc)
            details = [source_path(kind, obj, d) for d in exc.details]
            self._write(tracked, statuses.invalid_status(kind, exc.message, details, tracked.written))
            return
        except Exception as exc:  # a converter's bug must not stop the operator: the resource says why
            log.exception("converting %s", source)
            self._write(
                tracked, statuses.invalid_status(kind, f"{source} could not be read: {exc}", [], tracked.written)
            )
            return
        job_id = self.controller.submit(loaded, uid=tracked.uid)
        tracked.job_id = job_id
        if kind.status == "trainer":
            tracked.source_names = trainjob.replicated_job_names(loaded.job)
        scheduling = loaded.job.spec.scheduling
        tracked.min_available = scheduling.min_available or sum(r.replicas for r in loaded.job.spec.roles)
        self._adopt(tracked, loaded.job)

    def _adopt(self, tracked: Tracked, job: Any) -> None:
        """Give the job the uid of its resource (its pods' instance ids start with it) and take
        back the newest pod of each of its instances: attempt, address and phase come from the
        pod; the next pass observes it as any other."""

        label = k8s.label_value(tracked.uid)  # the job was submitted under its resource's uid
        newest: dict[tuple[str, int], dict[str, Any]] = {}
        for pod in self.backend.pods.items():
            labels = pod["metadata"].get("labels") or {}
            if labels.get(k8s.LABEL_JOB_UID) != label:
                continue
            key = (labels.get(k8s.LABEL_ROLE, ""), int(labels.get(k8s.LABEL_INDEX, 0)))
            if key not in newest or int(labels.get(k8s.LABEL_ATTEMPT, 0)) > int(
                newest[key]["metadata"]["labels"][k8s.LABEL_ATTEMPT]
            ):
                newest[key] = pod
        if not newest:
            return  # a new resource: nothing to take up (no transaction on its way to its pods)
        with self.sessions() as session:
            row = repo.load_job(session, tracked.job_id or 0)
            row.admitted = True
            row.started_at = utcnow()
            roles = {r.name: r for r in job.spec.roles}
            for (role, index), pod in newest.items():
                if role not in roles or index >= roles[role].replicas:
                    continue
                attempt = int(pod["metadata"]["labels"][k8s.LABEL_ATTEMPT])
                instance_id = f"{tracked.uid}/{role}-{index}/{attempt}"
                handle = self.backend.recover(instance_id, "")
                if handle is None:
                    continue
                obs = k8s.pod_observation(pod)
                ports = list(obs.ports or handle.ports or [])
                host = obs.host or k8s.POD_IP
                row.instances.append(
                    InstanceRow(
                        job_id=row.id,
                        role=role,
                        index=index,
                        state="starting",
                        reason="Adopted",
                        message=f"pod {pod['metadata']['name']} taken up by {self.identity}",
                        attempt=attempt,
                        restarts=attempt - 1,
                        handle=handle,
                        host=host,
                        ports=ports,
                        address=f"{host}:{ports[0]}" if ports else host,
                        cpu=roles[role].resources.cpu,
                        memory=roles[role].resources.memory_bytes,
                        started_at=utcnow(),
                    )
                )
            session.commit()
        self.controller.recover(job_ids=[tracked.job_id])

    def _owner_of(self, spec: Any) -> k8s.Owner | None:
        tracked = self._tracked.get(k8s.job_uid(spec))
        if tracked is None:
            return None
        if tracked.kind.status == "kubeflow":
            labels = {
                "training.kubeflow.org/job-name": tracked.name,
                "training.kubeflow.org/operator-name": "trainmaster",
                "training.kubeflow.org/replica-type": spec.role,
                "training.kubeflow.org/replica-index": str(spec.index),
            }
        elif tracked.kind.status == "volcano":
            labels = {
                "volcano.sh/job-name": tracked.name,
                "volcano.sh/job-namespace": tracked.namespace,
                "volcano.sh/task-spec": spec.role,
            }
        elif tracked.kind.status == "trainer":
            labels = trainjob.pod_labels(tracked.name, tracked.source_names.get(spec.role, spec.role), spec.index)
        else:
            labels = {}
        return k8s.Owner(tracked.api_version, tracked.kind.kind, tracked.name, tracked.uid, labels, tracked.namespace)

    # ---- a resource goes --------------------------------------------------------------------------
    def _deleted(self, uid: str) -> None:
        tracked = self._tracked.get(uid)
        if tracked is None:
            return
        tracked.deleted = True
        if tracked.job_id is not None:
            with self.sessions() as session:
                ended = repo.is_terminal(repo.load_job(session, tracked.job_id).state)
            if not ended:
                self.controller.cancel(tracked.job_id)  # its pods are stopped; the owner references do the rest

    # ---- status -----------------------------------------------------------------------------------
    def _write_statuses(self) -> None:
        """The status of every job the pass may have changed (those it loaded), and of any whose
        last write did not go through; a job the pass left alone has the status written last,
        so a pass over quiet jobs reads nothing more of the store."""
        touched = self.controller.touched
        live = [
            t
            for t in self._tracked.values()
            if t.job_id is not None and not t.deleted and (t.stale or t.job_id in touched)
        ]
        if not live:
            return
        for tracked in live:  # until its status is found unchanged or written (a failed write retries)
            tracked.stale = True
        with self.sessions() as session:
            documents = repo.status_summaries(session, [t.job_id or 0 for t in live])
        for tracked in live:
            doc = documents.get(tracked.job_id or 0)
            if doc is None:
                continue  # no longer in the cache (it cannot be, while tracked): nothing to write
            if tracked.kind.status == "kubeflow":
                new = statuses.kubeflow_status(tracked.kind, tracked.name, doc, tracked.replica_types, tracked.written)
            elif tracked.kind.status == "volcano":
                new = statuses.volcano_status(doc, tracked.min_available, tracked.written)
            elif tracked.kind.status == "trainer":
                new = trainjob.trainjob_status(doc, tracked.written, tracked.source_names)
            else:
                new = statuses.trainmaster_status(doc, tracked.written)
            if new != tracked.written:
                self._write(tracked, new)
            else:
                tracked.stale = False

    def _write(self, tracked: Tracked, status: dict[str, Any]) -> None:
        """Patch the status subresource, fenced twice: only while leading, and only over the
        version this leader last saw (a late write over a newer one fails with Conflict)."""
        from kubernetes.client.exceptions import ApiException

        self.elector.check()
        body: dict[str, Any] = {"status": status}
        if tracked.version:
            body["metadata"] = {"resourceVersion": tracked.version}
        try:
            answer = self.custom.patch_namespaced_custom_object_status(
                tracked.kind.group,
                tracked.api_version.partition("/")[2] or tracked.kind.storage_version,
                tracked.namespace,
                tracked.kind.plural,
                tracked.name,
                body,
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status == 404:
                tracked.deleted = True
                return
            if exc.status == 409:  # written meanwhile (by an earlier leader's late write): read it again
                tracked.version = self._read_version(tracked)
                return
            raise
        tracked.version = _newer(tracked.version, json.loads(answer.data))
        tracked.written = status
        tracked.stale = False

    def _read_version(self, tracked: Tracked) -> str:
        obj = json.loads(
            self.custom.get_namespaced_custom_object(
                tracked.kind.group,
                tracked.api_version.partition("/")[2] or tracked.kind.storage_version,
                tracked.namespace,
                tracked.kind.plural,
                tracked.name,
                _preload_content=False,
            ).data
        )
        return str((obj.get("metadata") or {}).get("resourceVersion") or "")

    @property
    def requests(self) -> int:
        """API requests of this process (the operator's own and its backends')."""
        return (
            int(self.api.requests)
            + self._past_requests
            + (int(self.backend.requests) if self.backend is not None else 0)
        )


def _newer(known: str, obj: dict[str, Any]) -> str:
    """The later of two resourceVersions (etcd's revisions: numbers, in practice)."""
    seen = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    try:
        return seen if not known or int(seen) >= int(known) else known
    except ValueError:
        return seen or known
