"""The multi-node deploy files: the LeaderWorkerSet (mp ranks across pods) and the Ray cluster (the KubeRay
manifest and deploy/ray/README.md) have the fields their controllers read, and every `engine serve` in
deploy/ parses with our own CLI into EngineArgs and ServerArgs, so that a flag renamed in the code fails
here; a worker's flags agree with its leader's. Offline: no processes, no network, no model."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from frontend.cli.main import build_parser
from frontend.config.engine_args import EngineArgs
from frontend.config.flags import from_namespace
from frontend.config.server_args import ServerArgs

DEPLOY = pathlib.Path(__file__).resolve().parent.parent / "deploy"
LWS = DEPLOY / "k8s" / "leaderworkerset.yaml"
RAY_CLUSTER = DEPLOY / "ray" / "raycluster.yaml"
RAY_README = DEPLOY / "ray" / "README.md"
LWS_RESTART_POLICIES = {"RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"}
# What an environment reference stands for when a command is parsed; one not listed fails the test.
LEADER_ADDRESS = "engine-tp-0.engine-tp.default"
PLACEHOLDERS = {"LWS_LEADER_ADDRESS": LEADER_ADDRESS, "LEADER_ADDRESS": LEADER_ADDRESS, "NODE_RANK": "1"}
VARIABLE = re.compile(r"\$\((\w+)\)|\$\{(\w+)\}|\$(\w+)")
SHELL_SEPARATOR = re.compile(r"\s*(?:&&|\|\||;|&|\n)\s*")


class Serve:
    """One `engine serve` found in deploy/: where, its argv as written, and its parsed configs."""

    def __init__(self, where: str, argv: list[str], values: dict[str, str]) -> None:
        self.where, self.argv = where, argv
        expanded = [VARIABLE.sub(lambda m: expand(m, values, where), token) for token in argv]
        try:
            namespace = strict_parser().parse_args(expanded[1:])  # without the program name, "engine"
        except SystemExit as error:  # argparse's exit: an unknown flag or a bad value (its message above)
            pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse (exit {error.code})")
        try:
            self.engine = from_namespace(EngineArgs, namespace)
            self.server = from_namespace(ServerArgs, namespace)
        except ValueError as error:
            pytest.fail(f"{where}: `{shlex.join(argv)}`: {error}")


def strict_parser() -> argparse.ArgumentParser:
    """The CLI's parser without argparse's prefix matching, under which a flag renamed to a longer name
    would still accept the old one (`--master-port` as an abbreviation of `--master-port-number`)."""
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for subparser in [parser, *commands.choices.values()]:
        subparser.allow_abbrev = False
    return parser


def expand(match: re.Match[str], values: dict[str, str], where: str) -> str:
    name = next(group for group in match.groups() if group)
    if name not in values:
        pytest.fail(f"{where}: no placeholder for ${name}: add one to PLACEHOLDERS")
    return values[name]


def documents(path: pathlib.Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def image_entrypoint() -> list[str]:
    """The engine image's ENTRYPOINT (what a container's `args` follow)."""
    line = re.search(r"^ENTRYPOINT (\[.*\])$", (DEPLOY / "Dockerfile.cpu").read_text(), re.M)
    assert line, "deploy/Dockerfile.cpu has no exec-form ENTRYPOINT"
    return list(json.loads(line.group(1)))


def serve_argvs(argv: list[str]) -> Iterator[list[str]]:
    """The `engine serve` commands in a container's argv: itself, or those of the script given to a shell
    (`bash -lc -- SCRIPT`), with `exec` and leading VAR=value assignments dropped."""
    if argv[:2] == ["engine", "serve"]:
        yield argv
        return
    if argv and pathlib.PurePath(argv[0]).name in ("sh", "bash") and len(argv) >= 3:
        for command in shell_commands(argv[-1]):
            if command[:2] == ["engine", "serve"]:
                yield command


def shell_commands(script: str) -> Iterator[list[str]]:
    """Each simple command of a script (split at ;, &&, ||, & and newlines; enough for our files)."""
    script = script.replace("\\\n", " ")
    for part in SHELL_SEPARATOR.split(script):
        words = shlex.split(part, comments=True)
        while words and (words[0] == "exec" or re.fullmatch(r"\w+=\S*", words[0])):
            words.pop(0)
        if words:
            yield words


def pod_specs(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) for every pod template in a manifest, found by its `containers`."""
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list):
            yield path, node
        for key, value in node.items():
            yield from pod_specs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from pod_specs(value, f"{path}[{index}]")


def placeholders(doc: dict[str, Any], where: str) -> dict[str, str]:
    """LWS's env for a pod of this template: its group size, and worker index 0 (leader) or 1."""
    values = dict(PLACEHOLDERS)
    if doc.get("kind") == "LeaderWorkerSet":
        values["LWS_GROUP_SIZE"] = str(doc["spec"]["leaderWorkerTemplate"]["size"])
        values["LWS_WORKER_INDEX"] = "1" if "workerTemplate" in where else "0"
    return values


def manifest_serves(path: pathlib.Path) -> list[Serve]:
    found = []
    for doc in documents(path):
        name = f"{path.relative_to(DEPLOY)} {doc['kind']}/{doc['metadata']['name']}"
        for where, spec in pod_specs(doc):
            for container in spec["containers"]:
                argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
                if "command" not in container and container.get("image", "").startswith("engine:"):
                    argv = image_entrypoint() + argv
                for serve in serve_argvs(argv):
                    at = f"{name}{where} {container['name']}"
                    found.append(Serve(at, serve, placeholders(doc, where)))
    return found


def markdown_serves(path: pathlib.Path, inline: bool = False) -> list[Serve]:
    """The `engine serve` commands of a Markdown file's code blocks (and of its inline code: in a README
    whose inline commands are all complete, none with a `-tp N` for the reader to fill in)."""
    text = path.read_text()
    found = []
    for block in re.findall(r"^```(?:bash|sh|shell)?\n(.*?)^```", text, flags=re.M | re.S):
        for command in shell_commands(block):
            if command[:2] == ["engine", "serve"]:
                found.append(Serve(f"{path.relative_to(DEPLOY)}", command, PLACEHOLDERS))
    for code in re.findall(r"`(?:[A-Z_]+=\S+ )?(engine serve [^`]+)`", text) if inline else []:
        found.append(Serve(f"{path.relative_to(DEPLOY)}", shlex.split(code), PLACEHOLDERS))
    return found


def check_metadata(doc: dict[str, Any]) -> None:
    assert isinstance(doc.get("apiVersion"), str) and doc["apiVersion"], doc
    assert isinstance(doc.get("kind"), str) and doc["kind"], doc
    assert isinstance(doc.get("metadata", {}).get("name"), str), doc


def check_pod_template(template: dict[str, Any], where: str) -> list[dict[str, Any]]:
    containers = template.get("spec", {}).get("containers")
    assert isinstance(containers, list) and containers, f"{where}: no containers"
    for container in containers:
        assert container.get("name") and container.get("image"), f"{where}: a container without name/image"
        assert container.get("command") or container.get("args"), f"{where}: {container['name']} runs nothing"
        for key in ("command", "args"):
            assert all(isinstance(a, str) for a in container.get(key, [])), f"{where}: {key} not strings"
    return containers


def check_service_selects(service: dict[str, Any], labels: dict[str, str], ports: set[str]) -> None:
    """The Service selects the pods with these labels (the template's and the controller's) and targets a
    named port they declare."""
    selector = service["spec"]["selector"]
    assert selector and selector.items() <= labels.items(), (selector, labels)
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in ports, (port, ports)


def probe_paths(container: dict[str, Any]) -> set[str]:
    return {
        container[probe]["httpGet"]["path"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe")
        if "httpGet" in container.get(probe, {})
    }


def deployment_probe_paths() -> set[str]:
    """The paths deployment.yaml's probes use (tests/test_deploy.py checks they are real routes)."""
    deployment = documents(DEPLOY / "k8s" / "deployment.yaml")[0]
    return probe_paths(deployment["spec"]["template"]["spec"]["containers"][0])


def leader_container(container: dict[str, Any], where: str) -> None:
    """Serves HTTP on a port named http, with the deployment's startup, liveness and readiness probes."""
    assert {p["name"] for p in container.get("ports", [])} >= {"http"}, where
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container.get(probe, {}).get("httpGet", {}).get("port") == "http", (where, probe)
    assert container["readinessProbe"]["httpGet"]["path"] == "/health", where
    assert probe_paths(container) <= deployment_probe_paths(), where


def test_leaderworkerset_has_the_fields_lws_reads() -> None:
    docs = documents(LWS)
    assert [d["kind"] for d in docs] == ["LeaderWorkerSet", "Service"]
    for doc in docs:
        check_metadata(doc)
    lws, service = docs
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert isinstance(lws["spec"]["replicas"], int) and lws["spec"]["replicas"] >= 1
    template = lws["spec"]["leaderWorkerTemplate"]
    assert isinstance(template["size"], int) and template["size"] >= 2
    assert template.get("restartPolicy", "RecreateGroupOnPodRestart") in LWS_RESTART_POLICIES
    (leader,) = check_pod_template(template["leaderTemplate"], "leaderTemplate")
    check_pod_template(template["workerTemplate"], "workerTemplate")
    leader_container(leader, "leaderTemplate")
    labels = {
        **template["leaderTemplate"]["metadata"]["labels"],
        "leaderworkerset.sigs.k8s.io/name": "engine-tp",
    }
    assert lws["metadata"]["name"] == "engine-tp"
    check_service_selects(service, labels, {p["name"] for p in leader["ports"]})
    # a leader's labels that a worker shares too would put workers (no HTTP) behind the Service
    worker_labels = template["workerTemplate"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= worker_labels.items()


def test_raycluster_has_the_fields_kuberay_reads() -> None:
    docs = documents(RAY_CLUSTER)
    assert [d["kind"] for d in docs] == ["RayCluster", "Service"]
    for doc in docs:
        check_metadata(doc)
    cluster, service = docs
    assert cluster["apiVersion"] == "ray.io/v1"
    head_group = cluster["spec"]["headGroupSpec"]
    assert isinstance(head_group.get("rayStartParams", {}), dict)
    (head,) = check_pod_template(head_group["template"], "headGroupSpec")
    leader_container(head, "headGroupSpec")
    groups = cluster["spec"]["workerGroupSpecs"]
    assert isinstance(groups, list) and groups
    for group in groups:
        assert group["groupName"], group
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group
        check_pod_template(group["template"], f"workerGroupSpecs {group['groupName']}")
    # our own container commands (the head starts Ray itself, then serves) need KubeRay's annotation
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    labels = {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    check_service_selects(service, labels, {p["name"] for p in head["ports"]})
    gcs_port = next(p["containerPort"] for p in head["ports"] if p["name"] == "gcs-server")
    assert f"ray start --head --port={gcs_port}" in " ".join(head["args"])


def test_lws_worker_joins_its_leader() -> None:
    (lws,) = (d for d in documents(LWS) if d["kind"] == "LeaderWorkerSet")
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    serves = manifest_serves(LWS)
    assert len(serves) == 2, [s.where for s in serves]
    leader, worker = serves
    assert "leaderTemplate" in leader.where and "workerTemplate" in worker.where
    assert leader.engine.model, "-tp 2 needs a model that splits over 2 ranks (not the bundled SmolLM2-135M)"
    assert leader.engine.tensor_parallel_size > 1 and leader.engine.nnodes == size
    assert leader.engine.node_rank == 0 and not leader.server.headless
    assert leader.engine.master_addr == LEADER_ADDRESS and leader.engine.master_port
    assert leader.engine.distributed_executor_backend == worker.engine.distributed_executor_backend == "mp"
    assert worker.server.headless, "a worker runs only its ranks: --headless"
    for knob in ("model", "tensor_parallel_size", "nnodes", "master_addr", "master_port"):
        assert getattr(worker.engine, knob) == getattr(leader.engine, knob), knob
    assert "$(LWS_WORKER_INDEX)" in worker.argv, "each worker's --node-rank is its LWS worker index"
    assert 0 < worker.engine.node_rank < worker.engine.nnodes
    (container,) = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    dist = next(p["containerPort"] for p in container["ports"] if p["name"] == "dist")
    assert (leader.server.host, leader.server.port, leader.engine.master_port) == ("0.0.0.0", http, dist)


def test_ray_commands_serve_over_ray() -> None:
    serves = manifest_serves(RAY_CLUSTER) + markdown_serves(RAY_README)
    assert len(serves) >= 3, [s.where for s in serves]  # the KubeRay head, two machines, one machine
    for serve in serves:
        assert serve.engine.distributed_executor_backend == "ray", serve.where
        assert serve.engine.tensor_parallel_size > 1 and serve.engine.model, serve.where
        assert serve.engine.nnodes == 1 and not serve.server.headless, serve.where  # Ray places the ranks
    text = RAY_README.read_text()
    for command in ("ray start --head --port=6379", "ray start --address=$HEAD_ADDRESS:6379", "ray stop"):
        assert command in text, command
    local = "ray start --head --port=6379 --node-ip-address=127.0.0.1"
    start = text.index(local)
    serve = text.index("RAY_ADDRESS=127.0.0.1:6379 engine serve", start)
    assert "ray stop" in text[serve:], "one machine: start Ray, serve, then stop Ray"


def test_every_engine_serve_in_deploy_parses() -> None:
    """Existing manifests too (a container with only `args` follows the image's ENTRYPOINT)."""
    serves = [s for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for s in manifest_serves(path)]
    serves += (
        manifest_serves(RAY_CLUSTER)
        + markdown_serves(RAY_README)
        + markdown_serves(DEPLOY / "README.md", inline=True)
    )
    wheres = {s.where.split()[0] for s in serves}
    assert {"k8s/deployment.yaml", "k8s/headless-topology.yaml", "k8s/leaderworkerset.yaml"} <= wheres
    assert {"ray/raycluster.yaml", "ray/README.md", "README.md"} <= wheres
    readme = [s for s in serves if s.where == "README.md"]
    worker = next(s for s in readme if s.server.headless)
    leader = next(s for s in readme if s.engine.nnodes > 1 and not s.server.headless)
    for knob in ("tensor_parallel_size", "nnodes", "master_port"):
        assert getattr(worker.engine, knob) == getattr(leader.engine, knob), knob


def test_every_manifest_api_server_reads_the_api_key_secret() -> None:
    """A container that answers HTTP (an `engine serve` that is not headless) takes the optional API-key
    secret, as deployment.yaml does: an attached frontend without it would serve without the keys."""
    checked = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in documents(path):
            for where, spec in pod_specs(doc):
                for container in spec["containers"]:
                    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
                    if "command" not in container and container.get("image", "").startswith("engine:"):
                        argv = image_entrypoint() + argv
                    if not serve_argvs(argv) or "--headless" in argv:
                        continue
                    env = {item["name"]: item for item in container.get("env", [])}
                    at = f"{path.name} {doc['metadata']['name']}{where} {container['name']}"
                    assert "ENGINE_API_KEY" in env, at
                    assert env["ENGINE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "engine-api-key", at
                    checked.append(at)
    assert any("headless-topology" in at for at in checked) and any("deployment.yaml" in at for at in checked)
