"""Controller benchmark, Kubernetes section (issue #30): submit -> every pod Running, Trainmaster's
operator against Kubernetes' own Job controller, the same pods on the same cluster in one run.

    .venv/bin/python bench/controller.py --kubernetes [--runs 5 | --runs-per-size 5,7,5] [--sizes 1,8,32]

Writes ``bench/results/controller_kubernetes.{json,md,png}``. A cluster of this machine is
brought up for the run (``trainmaster cluster up``, one node) and removed after; the operator
runs out of the cluster as ``trainmaster operator`` (its own process, metrics on a local port).

Each run creates, through the API, either a ``TrainingJob`` of N replicas (ours) or a
``batch/v1`` Job with ``parallelism = completions = N`` (Kubernetes'), whose pods are the same:
the ``busybox`` image built here, a 30 s sleep that ends on SIGTERM, ``imagePullPolicy: Never``, no requests.
The clock starts just before the create call and stops when a watch the benchmark opened
beforehand has seen N of the job's pods in phase ``Running``. Systems alternate (their order
flips every run); each job is deleted and its pods gone before the next, and a run starts only
once the kubelets make no more API requests than when idle: a kubelet's client is rate-limited
(50 requests per second, bursts of 100 on a cluster of ``trainmaster cluster up``; 1.20's default,
5 in bursts of 10, held 32 pods' Running reports back by 13-20 s) and reports each starting pod's
status up to twice (Pending, then Running; a GET and a PATCH each), so a run that began while
the deletion before still drew on that budget would start behind. Medians over runs, and the median of each run's
ratio to the Job run next to it. Where the time goes, per run: when every pod was bound and
Running, the CPU seconds of each part of the cluster (:class:`ClusterMeter`), the kubelets' API
requests.
Beside: the operator's resident memory (``process_resident_memory_bytes`` of its metrics) and
its API requests per job (``trainmaster_operator_api_requests_total`` before the create and
once every pod runs, a watch counting once).
"""

from __future__ import annotations

import calendar
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parent.parent
# the same pod for both systems: sleeps 30 s, and ends at once on SIGTERM (a plain ``sleep`` as the
# container's first process ignores it, so each deletion would wait out the 30 s grace period)
BUSYBOX_COMMAND = ["busybox", "sh", "-c", "trap 'exit 0' TERM; busybox sleep 30 & wait"]
TIMEOUT = 240.0
OURS, THEIRS = "trainmaster operator", "batch/v1 Job controller"


def pod_template(image: str) -> dict[str, Any]:
    return {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never", "command": BUSYBOX_COMMAND}],
    }


def our_job(name: str, replicas: int, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "trainmaster.io/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "framework": "command",
            "roles": [
                {
                    "name": "worker",
                    "replicas": replicas,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "runtime": "container",
                    "command": BUSYBOX_COMMAND,
                }
            ],
        },
    }


def batch_job(name: str, replicas: int, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": replicas,
            "completions": replicas,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": {"bench": name}}, "spec": pod_template(image)},
        },
    }


API_LABEL = re.compile(r'(\w+)="([^"]*)"')
EVENT = re.compile(r"^(\S+ \S+) \S+ \S+ \S+ (/containers/create|/tasks/start) (\{.*\})\s*$")


class ContainerdEvents:
    """The node's containerd event stream (``ctr events``), kept: per container id its image and
    when its task started (wall-clock seconds)."""

    def __init__(self, socket: str, pause_image_hint: str = "pause"):
        self.hint = pause_image_hint
        self.socket = socket
        self.images: dict[str, str] = {}
        self.started: dict[str, float] = {}
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            ["ctr", "--address", socket, "-n", "k8s.io", "events"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            match = EVENT.match(line)
            if not match:
                continue
            stamp, topic, body = match.groups()
            # "2026-11-30 03:30:00.123456789" (UTC): nanoseconds cut to microseconds for strptime
            day, clock = stamp.split(" ")
            whole, _, frac = clock.partition(".")
            at = calendar.timegm(time.strptime(f"{day} {whole}", "%Y-%m-%d %H:%M:%S"))
            at += float(f"0.{frac or '0'}")
            data = json.loads(body)
            with self._lock:
                if topic == "/containers/create":
                    self.images[data["id"]] = data.get("image", "")
                else:
                    self.started[data["container_id"]] = at

    def starts_between(self, t0: float, t1: float) -> dict[str, list[float]]:
        """Sandbox and container task starts in [t0, t1], seconds after t0, sorted."""
        out: dict[str, list[float]] = {"sandbox": [], "container": []}
        with self._lock:
            for cid, at in self.started.items():
                if t0 <= at <= t1:
                    kind = "sandbox" if self.hint in self.images.get(cid, "") else "container"
                    out[kind].append(at - t0)
        return {k: sorted(v) for k, v in out.items()}

    def tasks(self) -> int:
        """Tasks (containers and sandboxes) the node still has."""
        listed = subprocess.run(
            ["ctr", "--address", self.socket, "-n", "k8s.io", "tasks", "ls", "-q"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return len(listed.stdout.split())

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(timeout=10)


class OperatorDeployment:
    """The operator as ``trainmaster cluster manifests --api-address ... | kubectl apply -f -``
    makes it (the doc's way, nothing changed): two replicas, one leading on the Lease
    ``trainmaster-system/trainmaster-operator``, each pod requesting 100m CPU. The bench counts both
    pods' CPU (the standby's too) from their cgroups, and leaves the cluster without them (the CRDs
    stay: the process mode's operator installs the same ones)."""

    NAMESPACE = "trainmaster-system"
    NAME = "trainmaster-operator"
    SELECTOR = "app.kubernetes.io/name=trainmaster-operator"

    def __init__(self, cluster: Any):
        import yaml

        self.cluster = cluster
        self.kubeconfig = str(cluster.layout.kubeconfig)
        printed = subprocess.run(
            [
                str(Path(sys.executable).parent / "trainmaster"),
                "cluster",
                "manifests",
                "--api-address",
                f"{cluster.layout.api_address}:{cluster.layout.api_port}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        # what ``remove`` deletes: everything printed but the CRDs (deleting those would wait on every resource)
        self.owned = yaml.safe_dump_all(
            [doc for doc in yaml.safe_load_all(printed) if doc and doc.get("kind") != "CustomResourceDefinition"]
        )
        self.cgroups: dict[str, list[Path]] = {}  # pod name -> its folders in the cpuacct hierarchy
        self.leader = ""
        self._kubectl("apply", "-f", "-", stdin=printed)

    def _kubectl(self, *args: str, stdin: str | None = None, timeout: float = 320, check: bool = True) -> str:
        """kubectl's output; a failure raises unless ``check`` is off (then its output, maybe empty)."""
        done = subprocess.run(
            ["kubectl", "--kubeconfig", self.kubeconfig, *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def wait_leading(self, timeout: float = 300.0) -> str:
        """Until the Deployment has rolled out and its Lease names one of its Running pods; returns
        that pod's name. Then finds each pod's cgroup, so the meter asks the API nothing later."""
        self._kubectl(
            "-n", self.NAMESPACE, "rollout", "status", f"deployment/{self.NAME}", f"--timeout={int(timeout)}s"
        )
        deadline = time.monotonic() + timeout
        while True:
            pods = json.loads(self._kubectl("-n", self.NAMESPACE, "get", "pods", "-l", self.SELECTOR, "-o", "json"))
            running = {
                p["metadata"]["name"]: p["metadata"]["uid"]
                for p in pods["items"]
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
            }
            holder = self._kubectl(  # no Lease yet: kubectl fails, and we wait
                "-n",
                self.NAMESPACE,
                "get",
                "lease",
                self.NAME,
                "-o",
                "jsonpath={.spec.holderIdentity}",
                timeout=60,
                check=False,
            ).strip()
            if holder in running:
                break
            if time.monotonic() > deadline:
                logs = self._kubectl("-n", self.NAMESPACE, "logs", "-l", self.SELECTOR, "--tail", "20")
                raise RuntimeError(
                    f"no operator pod led within {timeout:.0f} s (Lease holder {holder!r}); logs: {logs}"
                )
            time.sleep(0.5)
        self.leader = holder
        for name, uid in running.items():
            found: list[Path] = []
            for node in self.cluster.layout.nodes:
                found += Path(f"/sys/fs/cgroup/cpuacct{node.cgroup_root}").glob(f"**/pod{uid}")
            if not found:
                raise RuntimeError(f"the cgroup of operator pod {name} (uid {uid}) was not found")
            self.cgroups[name] = found
        return holder

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of each operator pod (its cgroup: the operator and the pod's pause)."""
        out: dict[str, float] = {}
        for name, folders in self.cgroups.items():
            try:
                out[name] = sum(int((f / "cpuacct.usage").read_text()) for f in folders) / 1e9
            except OSError:  # the pod is gone; a replacement would not be counted
                out[name] = 0.0
        return out

    def leader_processes(self) -> list[int]:
        """The leader pod's processes but its pause: the operator's Python."""
        found = []
        for folder in self.cgroups.get(self.leader, []):
            for procs in folder.glob("*/cgroup.procs"):
                for pid in map(int, procs.read_text().split()):
                    try:
                        if Path(f"/proc/{pid}/comm").read_text().strip() != "pause":
                            found.append(pid)
                    except OSError:
                        continue  # exited meanwhile
        return found

    def rss_bytes(self) -> float:
        """Resident memory of the leader's processes (the operator's Python; the pod's pause left out)."""
        total = 0
        for pid in self.leader_processes():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            total += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        return float(total)

    def nice(self) -> int | None:
        """The nice value of the leader's operator process (it inherits the node's containerd's)."""
        for pid in self.leader_processes():
            try:
                return os.getpriority(os.PRIO_PROCESS, pid)
            except OSError:
                continue
        return None

    def remove(self) -> None:
        self._kubectl("delete", "--ignore-not-found", "--wait=true", "--timeout=120s", "-f", "-", stdin=self.owned)


class ClusterMeter:
    """What a run costs the cluster, to see where the time goes: CPU seconds of each daemon (with
    the children it reaped: CNI plugins under containerd), of the container shims (with their
    runc calls) and pods of every node, and of the operator; and the kubelets' API requests (a
    kubelet's client is rate-limited, 50 per second with bursts of 100 on our clusters: a start of N
    pods costs each node's kubelet several requests per pod). With ``deployment`` the operator is
    its pods (their cgroups' CPU), and ``pods`` leaves them out: only the gangs' pods."""

    def __init__(self, cluster: Any, operator_pid: int, deployment: OperatorDeployment | None = None):
        self.cluster = cluster
        self.operator_pid = operator_pid
        self.deployment = deployment
        self._api: Any = None  # the API server's client, made at the first ``api_server``

    @staticmethod
    def _cpu(pid: int) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return 0.0
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def processes(self) -> dict[str, dict[int | str, float]]:
        """CPU seconds so far of each process, by component (a shim's pid: one pod; the operator's
        pods by name in deployment mode)."""
        from trainmaster.cluster.processes import pids_with_argument

        operator: dict[int | str, float] = (
            {name: cpu for name, cpu in self.deployment.cpu().items()}
            if self.deployment
            else {self.operator_pid: self._cpu(self.operator_pid)}
        )
        found: dict[str, dict[int | str, float]] = {"operator": operator}
        for record in self.cluster.daemons.records():
            if record.name.endswith("-namespaces"):
                continue
            component = (
                record.name.rsplit("-", 1)[1] if record.name.endswith(("-kubelet", "-containerd")) else record.name
            )
            found.setdefault(component, {})[record.pid] = self._cpu(record.pid)
        for node in self.cluster.layout.nodes:
            shims = found.setdefault("shims", {})
            for pid in pids_with_argument(node.containerd_socket):
                shims[pid] = self._cpu(pid)
        return found

    def pods_cpu(self) -> float:
        total = 0.0
        for node in self.cluster.layout.nodes:
            try:
                total += int(Path(f"/sys/fs/cgroup/cpuacct{node.cgroup_root}/cpuacct.usage").read_text()) / 1e9
            except OSError:
                pass
        return total - (sum(self.deployment.cpu().values()) if self.deployment else 0.0)

    def kubelet_requests(self) -> float:
        """API requests the kubelets made so far (``rest_client_requests_total`` of each)."""
        import ssl

        pki = self.cluster.pki
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # a kubelet serves a self-signed certificate of its own
        context.load_cert_chain(str(pki.kubelet_client_cert), str(pki.kubelet_client_key))
        total = 0.0
        for node in self.cluster.layout.nodes:
            url = f"https://{node.address}:{node.kubelet_port}/metrics"
            text = urllib.request.urlopen(url, timeout=10, context=context).read().decode()
            total += sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("rest_client_requests_total{")
            )
        return total

    def api_server(self) -> dict[str, float]:
        """The API server's counters so far: requests by ``VERB resource[/subresource]`` (a
        watch counts when it ends), watch events sent by kind (``watch KIND``: one per watcher an
        event reaches), and etcd operations by ``etcd OPERATION TYPE``."""
        if self._api is None:
            from kubernetes import client, config

            configuration = client.Configuration()
            config.load_kube_config(config_file=str(self.cluster.layout.kubeconfig), client_configuration=configuration)
            self._api = client.ApiClient(configuration)
        configuration = self._api.configuration
        answer = self._api.rest_client.request(
            "GET",
            f"{configuration.host}/metrics",
            headers={"authorization": configuration.get_api_key_with_prefix("BearerToken")},
        )
        counts: dict[str, float] = {}
        for line in answer.read().decode().splitlines():
            if line.startswith("apiserver_request_total{"):
                labels = dict(API_LABEL.findall(line))
                what = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
                key = f"{labels.get('verb', '')} {what or '-'}"
            elif line.startswith("apiserver_watch_events_total{"):
                key = f"watch {dict(API_LABEL.findall(line)).get('kind', '')}"
            elif line.startswith("etcd_request_duration_seconds_count{"):
                labels = dict(API_LABEL.findall(line))
                key = f"etcd {labels.get('operation', '')} {labels.get('type', '').lstrip('*')}"
            else:
                continue
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    def snapshot(self) -> dict[str, Any]:
        return {
            "processes": self.processes(),
            "pods": self.pods_cpu(),
            "kubelet_requests": self.kubelet_requests(),
        }

    @staticmethod
    def spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
        """CPU seconds by component between two snapshots (a process born meanwhile: all of it),
        ``pods``, and ``kubelet_requests``."""
        out: dict[str, float] = {}
        for component, pids in after["processes"].items():
            earlier = before["processes"].get(component, {})
            out[component] = round(sum(cpu - earlier.get(pid, 0.0) for pid, cpu in pids.items()), 3)
        out["pods"] = round(after["pods"] - before["pods"], 3)
        out["kubelet_requests"] = after["kubelet_requests"] - before["kubelet_requests"]
        return out

    @staticmethod
    def api_grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """The API server's counters (:meth:`api_server`) that grew between two readings, with three sums: ``writes``
        (POST, PUT, PATCH, DELETE), ``watch events`` (sent, one per watcher), ``etcd operations``."""
        grew = {key: count - before.get(key, 0.0) for key, count in after.items() if count > before.get(key, 0.0)}
        writes = ("POST ", "PUT ", "PATCH ", "DELETE ")
        return {
            "writes": sum(v for k, v in grew.items() if k.startswith(writes)),
            "watch events": sum(v for k, v in grew.items() if k.startswith("watch ")),
            "etcd operations": sum(v for k, v in grew.items() if k.startswith("etcd ")),
            **dict(sorted(grew.items())),
        }

    def idle_rate(self, seconds: float = 10.0) -> float:
        """The kubelets' API requests per second with no pod to start or stop (node status,
        leases)."""
        before = self.kubelet_requests()
        time.sleep(seconds)
        self.idle = (self.kubelet_requests() - before) / seconds
        return self.idle

    idle = 2.0

    def wait_quiet(self, window: float = 3.0, limit: float = 60.0) -> float:
        """Wait until the kubelets make no more API requests than when idle over ``window``
        seconds (the deletion before has ended on the nodes too, and each run starts with their
        rate limiters refilled); returns the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < limit:
            before = self.kubelet_requests()
            time.sleep(window)
            if self.kubelet_requests() - before <= self.idle * window + 1:
                break
        return time.monotonic() - start


class Bench:
    def __init__(
        self,
        kubeconfig: str,
        metrics_port: int,
        meter: ClusterMeter | None = None,
        events: list[ContainerdEvents] | None = None,
    ):
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        self.api = client.ApiClient(configuration)
        self.core: Any = client.CoreV1Api(self.api)
        self.batch: Any = client.BatchV1Api(self.api)
        self.custom: Any = client.CustomObjectsApi(self.api)
        self.metrics_port = metrics_port
        self.meter = meter
        self.events = events or []  # the nodes' containerd event streams: when sandboxes and containers started

    def wait_leading(self, operator: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
        """Until the operator's metrics say it leads (its Lease won); raises with the tail of its
        ``log`` when it exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.metric("trainmaster_leading") == 1:
                    return
            except (OSError, KeyError):
                pass
            if time.monotonic() > deadline or operator.poll() is not None:
                raise RuntimeError(
                    f"the operator did not lead within {timeout:.0f} s; its log: {log.read_text()[-2000:]}"
                )
            time.sleep(0.5)

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def run(self, system: str, replicas: int, image: str) -> dict[str, Any]:
        name = f"b{secrets.token_hex(3)}"
        selector = f"trainmaster.io/job-name={name}" if system == OURS else f"bench={name}"
        stages: dict[str, float] = {}  # stage -> when the watch had seen every pod reach it
        seen = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(selector, replicas, seen, stages), daemon=True)
        watcher.start()
        seen.wait(10)  # the watch is open
        quiet_s = self.meter.wait_quiet() if self.meter else 0.0
        # no metrics port: the operator runs as the Deployment, which serves none
        requests_before = self.metric("trainmaster_operator_api_requests_total") if self.metrics_port else 0.0
        # the API server's counters outside the CPU window (its /metrics page is ~2 MB to make)
        api_before = self.meter.api_server() if self.meter else {}
        costs_before = self.meter.snapshot() if self.meter else None
        start, start_wall = time.perf_counter(), time.time()
        if system == OURS:
            self.custom.create_namespaced_custom_object(
                "trainmaster.io", "v1", "default", "trainingjobs", our_job(name, replicas, image)
            )
        else:
            self.batch.create_namespaced_job("default", batch_job(name, replicas, image), _preload_content=False)
        watcher.join(TIMEOUT)
        if "running" not in stages:
            raise RuntimeError(f"{system}: not every one of {replicas} pods Running after {TIMEOUT:.0f} s")
        costs_after = self.meter.snapshot() if self.meter and costs_before else None
        costs = self.meter.spent(costs_before, costs_after) if self.meter and costs_before and costs_after else {}
        api = self.meter.api_grew(api_before, self.meter.api_server()) if self.meter else {}
        if self.events:
            # the node's side: when the last sandbox and the last container started (containerd's
            # clock), against when the last pod was seen Running (the kubelet saw it at a relist)
            end_wall = time.time()
            time.sleep(0.2)  # the last events reach their streams
            started: dict[str, list[float]] = {"sandbox": [], "container": []}
            for stream in self.events:
                for kind, seconds in stream.starts_between(start_wall, end_wall).items():
                    started[kind] += seconds
            if len(started["container"]) >= replicas:
                stages["sandboxes_started"] = start + max(started["sandbox"], default=0.0)
                stages["containers_started"] = start + max(started["container"])
        requests = (
            self.metric("trainmaster_operator_api_requests_total") - requests_before if self.metrics_port else None
        )
        self._delete(system, name, selector)
        return {
            "running_s": stages["running"] - start,
            "created_s": stages.get("created", stages["running"]) - start,
            # when every pod had been seen bound to a node, with an IP, Running
            "stages_s": {stage: round(at - start, 3) for stage, at in stages.items()},
            "operator_requests": requests,
            "quiet_wait_s": round(quiet_s, 2),
            "costs": costs,
            "api_server": api,  # what the API server did from the submit to every pod Running
        }

    def _watch(self, selector: str, replicas: int, opened: threading.Event, stages: dict[str, float]) -> None:
        """Until every pod is Running: when the watch had seen every pod created, bound to a
        node, given an IP, Running (a stage a pod skipped between two events counts as reached)."""
        from kubernetes import watch

        reached: dict[str, set[str]] = {stage: set() for stage in ("created", "bound", "ip", "running")}
        stream = watch.Watch()
        opened.set()
        for event in stream.stream(
            self.core.list_namespaced_pod, "default", label_selector=selector, timeout_seconds=int(TIMEOUT)
        ):
            pod = event["object"]
            now = time.perf_counter()
            running = pod.status.phase == "Running"
            marks = {
                "created": True,
                "bound": bool(pod.spec.node_name) or running,
                "ip": bool(pod.status.pod_ip) or running,
                "running": running,
            }
            for stage, hit in marks.items():
                if hit:
                    reached[stage].add(pod.metadata.name)
                    if len(reached[stage]) >= replicas and stage not in stages:
                        stages[stage] = now
            if "running" in stages:
                stream.stop()
                return

    def _delete(self, system: str, name: str, selector: str) -> None:
        if system == OURS:
            self.custom.delete_namespaced_custom_object("trainmaster.io", "v1", "default", "trainingjobs", name)
        else:
            self.batch.delete_namespaced_job(name, "default", propagation_policy="Background", _preload_content=False)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if not self.core.list_namespaced_pod("default", label_selector=selector).items:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the pods of {name} were not gone after {TIMEOUT:.0f} s")


def start_operator(cluster: Any, home: Path, log: BinaryIO, metrics_port: int) -> subprocess.Popen:
    """``trainmaster operator`` (container runtime) on ``cluster``, its home at ``home``, its output
    to ``log``, its metrics on ``metrics_port``. TM_BENCH_PROFILE=FILE: it runs under cProfile,
    its profile written to FILE when it stops. TM_BENCH_OPERATOR_NICE=N: it runs N nice steps below
    the benchmark (a diagnostic: does its CPU in the start window delay the node?)."""
    profile = os.environ.get("TM_BENCH_PROFILE")
    lower = int(os.environ.get("TM_BENCH_OPERATOR_NICE") or 0)
    return subprocess.Popen(
        [
            *([sys.executable, "-m", "cProfile", "-o", profile] if profile else []),
            str(Path(sys.executable).parent / "trainmaster"),
            "operator",
            "--runtime",
            "container",
            "--metrics-port",
            str(metrics_port),
        ],
        env={**os.environ, "KUBECONFIG": str(cluster.layout.kubeconfig), "TRAINMASTER_HOME": str(home)},
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.nice(lower)) if lower else None,
    )


def stop_operator(operator: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL for an operator that has not stopped within 20 s."""
    operator.terminate()
    try:
        operator.wait(timeout=20)
    except subprocess.TimeoutExpired:
        operator.kill()
        operator.wait(timeout=20)


def skipped_without_cluster(script: str, cluster: str | None) -> bool:
    """A diagnostic that needs a cluster someone brought up says why it does nothing without one
    (``make bench`` runs every bench/*.py with no arguments)."""
    if cluster is None:
        print(
            f"{Path(script).name}: skipped: it needs an existing cluster: trainmaster cluster up --name NAME, then --cluster NAME"
        )
    return cluster is None


def summary(samples: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "samples": [round(s, 3) for s in samples],
    }


def run_and_write(
    runs: int | list[int],
    sizes: list[int],
    out: Path,
    nodes: int = 1,
    cluster_name: str = "",
    operator_mode: str = "process",
) -> dict[str, Any]:
    """``runs``: per size, or one count for every size. ``cluster_name``: an existing cluster
    (``trainmaster cluster up --name``), used and left up; else one of ``nodes`` node(s) is
    brought up for the run and removed after. ``operator_mode``: ``process`` (``trainmaster
    operator`` beside the bench) or ``deployment`` (the printed manifests applied; removed after)."""
    if operator_mode not in ("process", "deployment"):
        raise ValueError(f"operator mode {operator_mode!r}: process or deployment")
    per_size = dict(zip(sizes, runs)) if isinstance(runs, list) else {size: runs for size in sizes}
    from trainmaster.cluster import Cluster, ClusterOptions, remove
    from trainmaster.cluster.images import BUSYBOX
    from trainmaster.cluster.layout import free_ports

    scratch = Path(tempfile.mkdtemp(prefix="tm-bench-k8s-"))
    name = cluster_name or f"b{secrets.token_hex(2)}"
    if cluster_name:
        cluster = Cluster.load(cluster_name)
        nodes = len(cluster.layout.nodes)
    else:
        cluster = Cluster.up(ClusterOptions(name=name, nodes=nodes), root=scratch / "clusters")
    log = open(scratch / "operator.log", "wb")
    operator: subprocess.Popen | None = None
    deployment: OperatorDeployment | None = None
    if operator_mode == "process":
        port = free_ports(1)[0]
        operator = start_operator(cluster, scratch / "home", log, port)
    else:
        port = 0  # the Deployment serves no metrics
        deployment = OperatorDeployment(cluster)
    events = [ContainerdEvents(node.containerd_socket) for node in cluster.layout.nodes]
    results: dict[str, Any] = {
        "meta": {
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "cpus": os.cpu_count(),
            "kubernetes": cluster.layout.version,
            "nodes": nodes,
            "cluster": "existing (--cluster)" if cluster_name else "brought up for the run",
            "runs": per_size,
            "pod": f"{BUSYBOX} {' '.join(BUSYBOX_COMMAND)}",
            "load_at_start": round(os.getloadavg()[0], 2),
            "command": " ".join([".venv/bin/python", "bench/controller.py", *sys.argv[1:]]),
            "priority": os.getpriority(os.PRIO_PROCESS, 0),
            "operator": operator_mode,
        },
        "submit_to_running": {OURS: {}, THEIRS: {}},
        "operator": {},
    }
    try:
        meter = ClusterMeter(cluster, operator.pid if operator else 0, deployment)
        bench = Bench(str(cluster.layout.kubeconfig), port, meter, events)
        if operator:
            bench.wait_leading(operator, scratch / "operator.log")
        else:
            assert deployment is not None
            leader = deployment.wait_leading()
            results["meta"]["operator_leader"] = leader
            results["meta"]["operator_nice"] = deployment.nice()
        bench.run(OURS, 1, BUSYBOX)  # warm: the CRD's first objects, the first pods of the node
        bench.run(THEIRS, 1, BUSYBOX)
        if bench.meter is not None:
            bench.meter.idle_rate()
        for size in sizes:
            samples: dict[str, list[dict[str, float]]] = {OURS: [], THEIRS: []}
            load_before = round(os.getloadavg()[0], 2)
            for run in range(per_size[size]):
                for system in (OURS, THEIRS) if run % 2 == 0 else (THEIRS, OURS):
                    measured = bench.run(system, size, BUSYBOX)
                    samples[system].append(measured)
                    print(
                        f"  {size:3d} pods, {system}: {measured['running_s']:.2f} s ("
                        + ", ".join(f"{k} {v:.2f}" for k, v in measured["stages_s"].items())
                        + "; "
                        f"waited {measured['quiet_wait_s']:.1f} s for quiet kubelets), "
                        + ", ".join(f"{k} {v:g}" for k, v in measured["costs"].items())
                        + "; API server: "
                        + ", ".join(
                            f"{k} {measured['api_server'].get(k, 0):g}"
                            for k in ("writes", "watch events", "etcd operations")
                        ),
                        flush=True,
                    )
            for system, measured in samples.items():
                entry = summary([m["running_s"] for m in measured])
                entry["created_median_s"] = statistics.median(m["created_s"] for m in measured)
                entry["stages_median_s"] = {
                    stage: statistics.median(m["stages_s"][stage] for m in measured)
                    for stage in ("created", "bound", "containers_started", "running")
                    if all(stage in m["stages_s"] for m in measured)
                }
                entry["costs_median"] = {
                    component: statistics.median(m["costs"].get(component, 0.0) for m in measured)
                    for component in sorted({c for m in measured for c in m["costs"]})
                }
                entry["api_server_median"] = {
                    key: statistics.median(m["api_server"].get(key, 0.0) for m in measured)
                    for key in sorted({k for m in measured for k in m.get("api_server", {})})
                }
                entry["runs"] = measured
                if system == OURS and all(m["operator_requests"] is not None for m in measured):
                    entry["operator_requests_median"] = statistics.median(m["operator_requests"] for m in measured)
                entry["load"] = [load_before, round(os.getloadavg()[0], 2)]  # 1-minute load before and after
                results["submit_to_running"][system][str(size)] = entry
                print(
                    f"{system:24s} {size:3d} pods: every pod Running after {entry['median_s']:.2f} s "
                    f"(1-minute load {entry['load'][0]} -> {entry['load'][1]})",
                    flush=True,
                )
            ratio = (
                results["submit_to_running"][OURS][str(size)]["median_s"]
                / results["submit_to_running"][THEIRS][str(size)]["median_s"]
            )
            results["submit_to_running"].setdefault("ratio", {})[str(size)] = round(ratio, 3)
            # each run of ours against the Job run next to it (the same moment's load), median
            paired = [o["running_s"] / t["running_s"] for o, t in zip(samples[OURS], samples[THEIRS])]
            results["submit_to_running"].setdefault("paired_ratio", {})[str(size)] = round(statistics.median(paired), 3)
            if all("containers_started" in m["stages_s"] for m in samples[OURS] + samples[THEIRS]):
                # the same, up to the node's last container start (without the kubelet's relist phase)
                started = [
                    o["stages_s"]["containers_started"] / t["stages_s"]["containers_started"]
                    for o, t in zip(samples[OURS], samples[THEIRS])
                ]
                results["submit_to_running"].setdefault("paired_ratio_containers_started", {})[str(size)] = round(
                    statistics.median(started), 3
                )
                print(f"paired ratio, every container started: {statistics.median(started):.3f}", flush=True)
        results["operator"] = (
            {
                "rss_bytes": bench.metric("process_resident_memory_bytes"),
                "api_requests_total": bench.metric("trainmaster_operator_api_requests_total"),
            }
            if operator
            else {"rss_bytes": deployment.rss_bytes() if deployment else 0.0, "api_requests_total": None}
        )
    finally:
        for stream in events:
            stream.close()
        if operator:
            stop_operator(operator)
        if deployment:
            deployment.remove()
        log.close()
        if os.environ.get("TM_BENCH_OPERATOR_LOG"):  # =FILE: keep the operator's log there
            shutil.copy(scratch / "operator.log", os.environ["TM_BENCH_OPERATOR_LOG"])
        if not cluster_name:
            remove(name, root=scratch / "clusters")
        shutil.rmtree(scratch, ignore_errors=True)
    results["meta"]["load_at_end"] = round(os.getloadavg()[0], 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "controller_kubernetes.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "controller_kubernetes.md").write_text(markdown(results))
    plot(results, out / "controller_kubernetes.png")
    return results


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    runs = meta["runs"]
    runs_text = (
        f"{runs} runs per size"
        if not isinstance(runs, dict)
        else ", ".join(f"{n} runs of {size} pod(s)" for size, n in runs.items())
    )
    lines = [
        "# Controller benchmark: Kubernetes (submit -> every pod Running)",
        "",
        f"{meta['time']}, {meta['cpus']} CPUs, Kubernetes {meta['kubernetes']} ({meta['nodes']} node(s), "
        f"built here), pods `{meta['pod']}`, {runs_text} (medians; the two systems alternate, each run "
        "starts once the kubelets are back to their idle request rate), 1-minute load "
        f"{meta['load_at_start']} at the start and {meta['load_at_end']} at the end.",
        "",
        f"Command: `{meta.get('command', '.venv/bin/python bench/controller.py --kubernetes')}` at nice "
        f"{meta.get('priority', 0)}, on a cluster {meta.get('cluster', 'brought up for the run')}.",
        "",
        (
            "Operator: the Deployment of `trainmaster cluster manifests` applied unchanged (2 replicas on a Lease, "
            f"`requests: cpu 100m`; leader {meta.get('operator_leader', '?')}, its processes at nice "
            f"{meta.get('operator_nice', '?')}); its CPU below is its two pods' cgroups, `pods` the gangs' pods "
            "without them; its API requests per job are not counted (the Deployment serves no metrics)."
            if meta.get("operator") == "deployment"
            else "Operator: `trainmaster operator` out of the cluster, a process beside the bench at its priority."
        ),
        "",
        "| pods | Trainmaster operator (s) | batch/v1 Job controller (s) | ours / Kubernetes | paired runs' ratio (median) | every pod created: ours / Kubernetes' (s) | operator API requests per job | 1-minute load (before -> after) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    s = results["submit_to_running"]
    for size in s[OURS]:
        ours, theirs = s[OURS][size], s[THEIRS][size]
        paired = (s.get("paired_ratio") or {}).get(size)
        # the Deployment serves no metrics: its API requests are not counted
        requests = f"{ours['operator_requests_median']:.0f}" if "operator_requests_median" in ours else "-"
        lines.append(
            f"| {size} | {ours['median_s']:.2f} ({ours['min_s']:.2f}-{ours['max_s']:.2f}) | "
            f"{theirs['median_s']:.2f} ({theirs['min_s']:.2f}-{theirs['max_s']:.2f}) | "
            f"{s['ratio'][size]:.2f}x | {f'{paired:.2f}x' if paired is not None else '-'} | "
            f"{ours['created_median_s']:.2f} / {theirs['created_median_s']:.2f} | "
            f"{requests} | "
            f"{ours['load'][0]} -> {ours['load'][1]} |"
        )
    if all("costs_median" in s[system][size] for system in (OURS, THEIRS) for size in s[OURS]):
        components = sorted(
            {c for system in (OURS, THEIRS) for size in s[OURS] for c in s[system][size]["costs_median"]}
        )
        components = [c for c in components if c != "kubelet_requests"]
        lines += [
            "",
            "Where the time goes (medians, ours / the Job's): when every pod was seen bound to the node, "
            "when the node's containerd had started every container (its event stream; the kubelet sees a "
            "started container at its next relist, once a second, and only then reports the pod Running), and "
            "when every pod was seen Running, the CPU seconds each part of the cluster spent from the submit to every pod Running "
            "(a daemon with the children it reaped, e.g. CNI plugins under containerd; `shims`: the "
            "container shims with their runc calls; `pods`: the pods' cgroups), and the kubelets' API "
            "requests in that time (a kubelet's client is rate-limited: 50 per second, bursts of 100 on our clusters).",
            "",
            "| pods | every pod bound (s) | every container started (s) | every pod Running (s) | kubelet API requests | "
            + " | ".join(components)
            + " | CPU in all (s) |",
            "|---:|---:|---:|---:|---:|" + "---:|" * len(components) + "---:|",
        ]
        for size in s[OURS]:
            ours, theirs = s[OURS][size], s[THEIRS][size]
            cells = [
                f"{ours['stages_median_s']['bound']:.2f} / {theirs['stages_median_s']['bound']:.2f}",
                f"{ours['stages_median_s'].get('containers_started', float('nan')):.2f} / "
                f"{theirs['stages_median_s'].get('containers_started', float('nan')):.2f}",
                f"{ours['stages_median_s']['running']:.2f} / {theirs['stages_median_s']['running']:.2f}",
                f"{ours['costs_median'].get('kubelet_requests', 0):.0f} / {theirs['costs_median'].get('kubelet_requests', 0):.0f}",
                *(f"{ours['costs_median'].get(c, 0):.2f} / {theirs['costs_median'].get(c, 0):.2f}" for c in components),
                f"{sum(ours['costs_median'].get(c, 0) for c in components):.2f} / "
                f"{sum(theirs['costs_median'].get(c, 0) for c in components):.2f}",
            ]
            lines.append(f"| {size} | " + " | ".join(cells) + " |")
    if all(s[system][size].get("api_server_median") for system in (OURS, THEIRS) for size in s[OURS]):
        lines += [
            "",
            "What the API server did from the submit to every pod Running (medians, ours / the Job's; its "
            "`/metrics` read before the create and after, outside the CPU window): requests that write "
            "(POST, PUT, PATCH, DELETE: pods, bindings, statuses, Events, Leases, ...), watch events sent "
            "(one per watcher an event reaches), etcd operations; then every request, watch event or etcd "
            "operation whose medians differ by at least 4.",
            "",
            "| pods | writes | watch events | etcd operations | where they differ (ours / the Job's) |",
            "|---:|---:|---:|---:|---|",
        ]
        for size in s[OURS]:
            ours, theirs = s[OURS][size]["api_server_median"], s[THEIRS][size]["api_server_median"]
            sums = ("writes", "watch events", "etcd operations")
            differ = [
                f"{key} {ours.get(key, 0):.0f} / {theirs.get(key, 0):.0f}"
                for key in sorted(set(ours) | set(theirs))
                if key not in sums and abs(ours.get(key, 0) - theirs.get(key, 0)) >= 4
            ]
            lines.append(
                f"| {size} | "
                + " | ".join(f"{ours.get(k, 0):.0f} / {theirs.get(k, 0):.0f}" for k in sums)
                + f" | {'; '.join(differ) or '-'} |"
            )
    op = results.get("operator") or {}
    if op:
        lines += [
            "",
            f"Operator: resident memory {op['rss_bytes'] / 2**20:.0f} MiB at the end of the run; "
            + (
                f"{op['api_requests_total']:.0f} API requests in all (watches count once)."
                if op.get("api_requests_total") is not None
                else "its API requests not counted (no metrics in the Deployment)."
            ),
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = results["submit_to_running"]
    sizes = list(s[OURS])
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in (OURS, THEIRS):
        ax.plot([int(n) for n in sizes], [s[system][n]["median_s"] for n in sizes], marker="o", label=system)
    ax.set_xlabel("pods")
    ax.set_ylabel("submit -> every pod Running (s, median)")
    ax.set_title(f"Kubernetes {results['meta']['kubernetes']} on {results['meta']['cpus']} CPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
