"""The Helm chart (helm/via-sd), the serving image's Dockerfile and the Ray cluster-launcher config, offline.

Helm's own engine (helm-python-sdk: Helm v4's Go library) lints and renders the chart; rendered core
objects are checked with kubernetes-validate (strict: unknown fields refused); the RayService against
KubeRay's RayService schema (tests/data/kuberay-rayservice-v1.schema.yaml, core types from
kubernetes-validate); serveConfigV2 against Ray Serve's own ServeDeploySchema; the application's args
against the real ServeConfig and through the real `app_builder`. The GPU presets' sizing (docs/KUBERNETES.md,
"GPU sizing") is recomputed from their models' shapes, built by transformers on the meta device, and the engine's
own cache arithmetic. No cluster, no Docker, no Ray started, no weights.
"""

from __future__ import annotations

import copy
import functools
import http.server
import importlib.util
import json
import re
import shutil
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "via-sd"
GPU_PRESETS = ["values-llama2-70b.yaml", "values-qwen-72b.yaml", "values-llama31-70b.yaml"]
PRESETS = [*GPU_PRESETS, "values-cpu-demo.yaml"]
KUBE_VERSION = "1.30"  # the oldest Kubernetes the schemas are checked against (Chart.yaml: >= 1.25)
GPU = "nvidia.com/gpu"


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def preset(name: str | None) -> dict:
    return yaml.safe_load((CHART / name).read_text()) if name else {}


#: The least a release needs: a token Secret (the chart refuses open public ports, see test_auth_*).
AUTHED = {"auth": {"tokenSecret": {"name": "viasd-api-token"}}}


def render(chart, values: dict | None = None, release: str = "rel", auth: dict | None = AUTHED) -> list[dict]:
    """Every object the chart renders with these values on top of `auth` (NOTES.txt left out)."""
    out = chart.render(merged(auth or {}, values or {}), name=release, namespace="serving")
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def merged(*layers: dict) -> dict:
    """Helm's coalescing of user values (later wins; maps merge, lists are replaced)."""

    def merge(a, b):
        out = copy.deepcopy(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        return out

    out: dict = {}
    for layer in layers:
        out = merge(out, layer)
    return out


def serve_config_v2(docs: list[dict]) -> dict:
    return yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])


def app_args(docs: list[dict]) -> dict:
    (app,) = serve_config_v2(docs)["applications"]
    return app["args"]


def pod_specs(rs: dict) -> dict[str, dict]:
    rc = rs["spec"]["rayClusterConfig"]
    (worker,) = rc["workerGroupSpecs"]
    return {"head": rc["headGroupSpec"]["template"], "worker": worker["template"]}


def container(template: dict) -> dict:
    (c,) = template["spec"]["containers"]
    return c


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def everything() -> dict:
    """A preset with every optional part on: token, TLS and internal TLS Secrets, object-store init step, mask,
    metrics."""
    return merged(
        preset("values-qwen-72b.yaml"),
        {
            "auth": {"tokenSecret": {"name": "viasd-api-token"}},
            "tls": {"secretName": "viasd-tls"},
            "internalTLS": {"secretName": "viasd-internal-tls"},
            "mask": {"artifact": (ROOT / "viasd" / "masks" / "qwen2.5-coder-1.5b-instruct-r0.45.json").read_text()},
            "serviceMonitor": {"enabled": True, "vllmNames": True},
            "grafanaDashboard": {"enabled": True},
            "cacheDir": "/home/ray/.cache/via-sd",
            "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
            "networkPolicy": {
                "clients": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
                "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}],
            },
            "serve": {"limits": {"request_timeout_s": 300}, "grpc": {"request_timeout_s": 300}},
        },
    )


def all_values() -> list[tuple[str, dict]]:
    return [("default", {})] + [(p, preset(p)) for p in PRESETS] + [("everything", everything())]


# ---------------------------------------------------------------- lint and render


@pytest.mark.parametrize("name", [None] + PRESETS)
def test_lint_strict_passes_for_defaults_and_every_preset(name):
    report = helm.lint(CHART, preset(name) or AUTHED, strict=True, namespace="serving", kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 warning, 3 error
    assert report["total_charts_linted"] == 1


def test_lint_catches_a_broken_template(tmp_path):
    """The lint above can fail: the same chart with a template reading a missing value does."""
    broken = tmp_path / "via-sd"
    shutil.copytree(CHART, broken)
    with open(broken / "templates" / "pdb.yaml", "a") as f:
        f.write("\n{{ .Values.nothing.here }}\n")
    assert not helm.lint(CHART, AUTHED, strict=True)["errors"]  # the same values pass on the real chart
    report = helm.lint(broken, AUTHED, strict=True)
    assert report["errors"] or any(m["severity"] == 3 for m in report["messages"])


@pytest.mark.parametrize("name,values", all_values())
def test_every_preset_renders_objects_valid_for_kubernetes(chart, name, values):
    docs = render(chart, values)
    kinds = sorted(d["kind"] for d in docs)
    assert {"RayService", "ConfigMap", "NetworkPolicy", "PodDisruptionBudget"} <= set(kinds)
    assert "Secret" not in kinds
    checked = 0
    for doc in docs:
        if doc["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1"):
            continue  # custom resources: below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        checked += 1
    # the public Service is KubeRay's serveService: a core Service too
    svc = {"apiVersion": "v1", "kind": "Service", **one(docs, "RayService")["spec"]["serveService"]}
    kubernetes_validate.validate(svc, KUBE_VERSION, strict=True)
    assert checked >= 3


def test_kubernetes_validate_refuses_an_unknown_field(chart):
    """Strict validation is live: a misspelt field in the PodDisruptionBudget is an error."""
    pdb = one(render(chart), "PodDisruptionBudget")
    pdb["spec"]["maxUnavailabel"] = pdb["spec"].pop("maxUnavailable")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, KUBE_VERSION, strict=True)


# ---------------------------------------------------------------- the RayService against KubeRay's schema


@pytest.fixture(scope="module")
def rayservice_validator():
    schema = yaml.safe_load((ROOT / "tests" / "data" / "kuberay-rayservice-v1.schema.yaml").read_text())
    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    version = max(p.name for p in base.glob(f"v{KUBE_VERSION}.*-local-strict"))
    defs = json.loads((base / version / "_definitions.json").read_text())
    registry = Registry().with_resources(
        [
            (schema["$id"], Resource.from_contents(schema)),
            (defs["$id"], Resource.from_contents(defs)),
        ]
    )
    return jsonschema.Draft202012Validator(schema, registry=registry)


@pytest.mark.parametrize("name,values", all_values())
def test_rayservice_validates_against_the_kuberay_schema(chart, rayservice_validator, name, values):
    rs = one(render(chart, values), "RayService")
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in rayservice_validator.iter_errors(rs)]
    assert errors == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplica=1),  # typo
        lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="4"),  # a string
        lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"].pop("rayStartParams"),  # required
        lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(
            imagePullPolicy=None, resourcez={}
        ),  # an unknown core field inside the pod template
        lambda rs: rs["spec"].update(serveConfigV2={"applications": []}),  # must be a YAML string
    ],
)
def test_the_rayservice_schema_refuses_broken_objects(chart, rayservice_validator, mutate):
    rs = one(render(chart, preset("values-llama2-70b.yaml")), "RayService")
    mutate(rs)
    assert list(rayservice_validator.iter_errors(rs))


# ---------------------------------------------------------------- serveConfigV2 and the application's args


@pytest.mark.parametrize("name,values", all_values())
def test_serve_config_v2_is_valid_for_ray_serve_and_app_builder(chart, name, values):
    from ray.serve.schema import ServeDeploySchema

    from viasd.cluster.app import GRPC_SERVICERS, app_builder
    from viasd.cluster.serve_config import parse_serve_config

    docs = render(chart, values)
    scv2 = serve_config_v2(docs)
    ServeDeploySchema.model_validate(scv2)  # Ray Serve's own schema of serveConfigV2
    (app,) = scv2["applications"]
    assert app["import_path"] == "viasd.cluster.app:app_builder"
    config = parse_serve_config(app["args"])  # the real ServeConfig (InvalidParameterError if not)
    assert app["name"] == config.app_name
    assert app["route_prefix"] == config.http.route_prefix
    assert config.http.host == "0.0.0.0"
    assert config.pipelines[0].bind_host == "0.0.0.0"  # actors on other pods must reach each other
    # what viasd serve gives Serve's proxies (cluster/app.py http_options / grpc_options)
    timeouts = {"request_timeout_s": config.limits.request_timeout_s} if config.limits.request_timeout_s else {}
    assert scv2["http_options"] == {"host": "0.0.0.0", "port": config.http.port, **timeouts}
    timeouts = {"request_timeout_s": config.grpc.request_timeout_s} if config.grpc.request_timeout_s else {}
    assert scv2["grpc_options"] == {"port": config.grpc.port, "grpc_servicer_functions": GRPC_SERVICERS, **timeouts}
    # the values' serve block reaches the application unchanged (besides what the chart sets)
    user = merged(yaml.safe_load((CHART / "values.yaml").read_text())["serve"], values.get("serve", {}))
    for key in ("app_name", "backend", "default_params", "limits", "autoscaling"):
        given = user.get(key)  # (Helm drops a null value: the config's default applies)
        assert app["args"].get(key) == ({k: v for k, v in given.items() if v is not None} if key == "limits" else given)
    # the builder KubeRay's Serve calls accepts the args and makes one deployment of whole pipelines
    application = app_builder(dict(app["args"]))
    deployment = application._bound_deployment
    assert deployment.name == f"pipeline-{config.pipelines[0].name}"
    auto = deployment._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas) == (config.autoscaling.min_replicas, config.autoscaling.max_replicas)
    assert auto.target_ongoing_requests == config.autoscaling.target_ongoing_requests


def test_chart_schema_knows_exactly_the_serve_config_fields():
    """values.schema.json's `serve` lists ServeConfig's fields: a field added to or removed from
    cluster/serve_config.py shows up here."""
    from viasd.cluster.pipeline import PipelineConfig
    from viasd.cluster.serve_config import ServeConfig

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["serve"]
    assert set(schema["properties"]) == set(ServeConfig.model_fields)
    pipeline = schema["properties"]["pipelines"]["items"]["properties"]
    assert set(pipeline) <= set(PipelineConfig.model_fields)
    for group in ("http", "grpc", "autoscaling"):
        assert set(schema["properties"][group]["properties"]) == set(
            ServeConfig.model_fields[group].annotation.model_fields
        )


def test_values_yaml_serve_block_equals_cluster_serve_yaml_pipeline():
    """The chart's default pipeline is the embedded pair of cluster/serve.yaml."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())["serve"]
    local = yaml.safe_load((ROOT / "cluster" / "serve.yaml").read_text())
    assert values["pipelines"][0]["engine"]["verifier"] == local["pipelines"][0]["engine"]["verifier"]
    assert values["pipelines"][0]["engine"]["drafter"] == local["pipelines"][0]["engine"]["drafter"]
    assert values["http"]["port"] == local["http"]["port"] and values["grpc"]["port"] == local["grpc"]["port"]


# ---------------------------------------------------------------- GPUs, ports, probes, autoscaling


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_worker_holds_the_whole_pipeline_on_one_node(chart, name):
    """tp_size ranks of 0.8 GPU take a GPU each and the drafter's 0.2 goes beside one of them: tp_size GPUs."""
    values = preset(name)
    (p,) = values["serve"]["pipelines"]
    assert (p["tp_size"], p["verifier_gpus_per_rank"], p["drafter_gpus"]) == (NODE_GPUS, 0.8, 0.2)
    for tp_size in (NODE_GPUS, 4, 2):  # the same shares on smaller groups
        v = copy.deepcopy(values)
        v["serve"]["pipelines"][0]["tp_size"] = tp_size
        rs = one(render(chart, v), "RayService")
        pods = pod_specs(rs)
        res = container(pods["worker"])["resources"]
        assert res["limits"][GPU] == res["requests"][GPU] == tp_size
        head = container(pods["head"])["resources"]
        assert GPU not in head.get("limits", {}) and GPU not in head.get("requests", {})
        assert rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
        assert app_args([rs])["pipelines"][0]["tp_size"] == tp_size


@pytest.mark.parametrize(
    "tp, rank_share, drafter_share, devices",
    [
        (4, 1, 0.5, 5),  # whole-GPU ranks: the drafter's half needs a device of its own
        (8, 0.8, 0.2, 8),  # eight 0.8 ranks take eight devices; the drafter's 0.2 fits beside one
        (8, 0.8, 0.3, 9),  # ... and 0.3 does not
        (2, 0.5, 0.5, 2),  # two ranks share a device, the drafter takes another
        (2, 0.4, 0.2, 1),  # everything on one device
        (2, 2, 1, 5),  # two devices a rank
    ],
)
def test_worker_gpus_are_what_ray_packs_the_bundles_on(chart, tp, rank_share, drafter_share, devices):
    v = preset("values-llama2-70b.yaml")
    p = v["serve"]["pipelines"][0]
    p.update(tp_size=tp, verifier_gpus_per_rank=rank_share, drafter_gpus=drafter_share)
    assert container(pod_specs(one(render(chart, v), "RayService"))["worker"])["resources"]["limits"][GPU] == devices


def test_cpu_demo_asks_no_gpu(chart):
    rs = one(render(chart, preset("values-cpu-demo.yaml")), "RayService")
    for template in pod_specs(rs).values():
        res = container(template)["resources"]
        assert GPU not in res.get("limits", {}) and GPU not in res.get("requests", {})


# ---------------------------------------------------------------- GPU sizing of the presets (docs/KUBERNETES.md)

GB, GiB, KiB = 10**9, 2**30, 2**10
NODE_GPUS = 8  # a pipeline's GPUs: one node of eight 80 GB cards
CARD = 80 * GB  # an A100 / H100 80GB (they hold 79.6-80 GiB: the difference is margin)
RANK_RESERVE = 5 * GB  # a verifier rank's CUDA context, NCCL buffers, activations, full-vocabulary logits
DRAFTER_RESERVE = 3 * GB  # the drafter process's
PROCESS_HOST = 4 * GB  # host memory of a model process: Python, torch, CUDA and NCCL state
RAY_HOST = 8 * GB  # raylet, dashboard agent, Serve's proxy and the replica
REQUEST = 4096  # positions of a 4k-token request: prompt, output and draft block
SHARDED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # split across the ranks


@dataclass(frozen=True)
class Shape:
    """A model as its config.json describes it; `params`: the published count."""

    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int  # max_position_embeddings
    tied: bool  # tie_word_embeddings
    params: float


#: The presets' models, by their directory under /models (the Hugging Face repository's name).
MODELS = {
    "Llama-2-70b-chat-hf": Shape("llama", 8192, 28672, 80, 64, 8, 32000, 4096, False, 69e9),
    "Llama-2-7b-chat-hf": Shape("llama", 4096, 11008, 32, 32, 32, 32000, 4096, False, 6.7e9),
    "Qwen2.5-72B-Instruct": Shape("qwen2", 8192, 29568, 80, 64, 8, 152064, 32768, False, 72.7e9),
    "Qwen2.5-7B-Instruct": Shape("qwen2", 3584, 18944, 28, 28, 4, 152064, 32768, False, 7.6e9),
    "Llama-3.1-70B-Instruct": Shape("llama", 8192, 28672, 80, 64, 8, 128256, 131072, False, 70.6e9),
    "Llama-3.2-1B-Instruct": Shape("llama", 2048, 8192, 16, 32, 8, 128256, 131072, True, 1.24e9),
}


@functools.cache
def meta_model(name: str):
    """MODELS[name] built by transformers on the meta device (shapes only, no memory) as a MaskedLM."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from viasd.runtime import MaskedLM

    s = MODELS[name]
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[s.arch](
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        vocab_size=s.vocab,
        max_position_embeddings=s.context,
        tie_word_embeddings=s.tied,
    )
    with torch.device("meta"):
        return MaskedLM(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))


def rank_weight_bytes(lm, tp: int) -> int:
    """What a rank holds after `viasd.parallel.load_shard`: 1/tp of every layer's projections and of the head
    (when the vocabulary divides), the embedding and the norms whole."""
    head_split = lm.vocab_size % tp == 0
    total = 0
    for name, p in lm.model.named_parameters():
        split = (".layers." in name and name.split(".")[-2] in SHARDED) or (name == "lm_head.weight" and head_split)
        total += p.numel() * p.element_size() // (tp if split else 1)
    if lm.lm_head.weight is lm.embed.weight and head_split:  # tied: a sharded head of its own, read from the embedding
        total += lm.lm_head.weight.numel() * lm.lm_head.weight.element_size() // tp
    return total


def preset_sizing(values: dict) -> dict:
    """A GPU preset's sizing from its models' shapes and the engine's own arithmetic: KV bytes a position costs each
    actor (as actors/verifier.py and actors/drafter.py count them), the KV budget each actor gets (kv_cache_gib: what
    the GPU the drafter shares with a rank leaves, halved, in whole GiB), the blocks it buys (viasd.engine.kv_capacity)
    and the 4k-token requests they hold on the actor holding the fewest, under either cache policy."""
    import torch

    from viasd.config import CachePolicy
    from viasd.engine import kv_bytes_per_token, kv_capacity
    from viasd.runtime import LayerMask

    (p,) = values["serve"]["pipelines"]
    e, tp = p["engine"], p["tp_size"]
    q, d = meta_model(Path(e["verifier"]).name), meta_model(Path(e["drafter"]).name)
    mask = LayerMask.evenly_spaced(e["skip_ratio"], q.num_layers)
    w_rank = rank_weight_bytes(q, tp)
    w_drafter = sum(x.numel() * x.element_size() for x in d.model.parameters())
    per_token = {pol: kv_bytes_per_token(q, None, mask, CachePolicy(pol)) // tp for pol in ("separate", "shared")}
    drafter_token = d.kv_bytes_per_token()
    budget_gib = int((CARD - RANK_RESERVE - DRAFTER_RESERVE - w_rank - w_drafter) / 2 // GiB)

    def requests(token_bytes: int, lm) -> int:
        _, _, blocks = kv_capacity(
            token_bytes,
            torch.device("cpu"),
            max_batch=e["max_batch"],
            max_seq_len=None,
            kv_cache_gib=budget_gib,
            model_context=min(lm.config.max_position_embeddings, e["max_context"]),
            max_context=e["max_context"],
            block_size=e["kv_block_size"],
        )
        return blocks // -(-REQUEST // e["kv_block_size"])

    host = tp * (w_rank + PROCESS_HOST) + w_drafter + PROCESS_HOST + RAY_HOST
    return {
        "q": q,
        "d": d,
        "w_rank": w_rank,
        "w_drafter": w_drafter,
        "per_token": per_token,
        "drafter_token": drafter_token,
        "budget_gib": budget_gib,
        "requests": {pol: min(requests(per_token[pol], q), requests(drafter_token, d)) for pol in per_token},
        "host_gib": -(-host // (8 * GiB)) * 8,  # rounded up to 8 GiB
        "rank_gpu": w_rank + budget_gib * GiB + RANK_RESERVE,
        "shared_gpu": w_rank + w_drafter + 2 * budget_gib * GiB + RANK_RESERVE + DRAFTER_RESERVE,
    }


def sizing_rows(name: str) -> dict[str, str]:
    """Preset `name`'s column of the docs' table, as computed."""
    values = preset(name)
    s = preset_sizing(values)
    e = values["serve"]["pipelines"][0]["engine"]
    tok = s["per_token"]
    return {
        "models under /models: q / p": f"`{Path(e['verifier']).name}` / `{Path(e['drafter']).name}`",
        "GPUs per pod (one node)": str(NODE_GPUS),
        "host memory per pod": f"{s['host_gib']} GiB",
        "weights per GPU: a rank / the drafter": f"{s['w_rank'] / GB:.1f} / {s['w_drafter'] / GB:.1f} GB",
        "KV per position, a rank: separate / shared": f"{tok['separate'] // KiB} / {tok['shared'] // KiB} KiB",
        "KV per position, the drafter": f"{s['drafter_token'] // KiB} KiB",
        "`kv_cache_gib` (each actor)": str(s["budget_gib"]),
        "KV per GPU: a rank's / the shared one": f"{s['budget_gib']} / {2 * s['budget_gib']} GiB",
        "GPU in use: a rank's / the shared one": f"{s['rank_gpu'] / GB:.1f} / {s['shared_gpu'] / GB:.1f} GB",
        "concurrent 4k requests: separate / shared": f"{s['requests']['separate']} / {s['requests']['shared']}",
    }


def docs_sizing_table(text: str) -> dict[str, dict[str, str]]:
    """The presets' table in docs/KUBERNETES.md's "GPU sizing": {row label: {preset file: cell}}."""
    lines = text.split("\n## GPU sizing", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and "`values-" in line)
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    header, _rule, *body = rows
    files = [c.strip("`") for c in header[1:]]
    return {row[0]: dict(zip(files, row[1:], strict=True)) for row in body}


def sizing_mismatches(text: str) -> list[str]:
    """Every cell of the docs' table that differs from the computed sizing."""
    table = docs_sizing_table(text)
    out = []
    for name in GPU_PRESETS:
        rows = sizing_rows(name)
        out += [f"rows {sorted(set(table) ^ set(rows))}"] if set(table) != set(rows) else []
        for label, cell in rows.items():
            if table.get(label, {}).get(name) != cell:
                out.append(f"{name}, {label}: docs {table.get(label, {}).get(name)!r}, computed {cell!r}")
    return out


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_preset_fits_one_node_as_sized(chart, name):
    """The preset's models (their published sizes, shardable, one vocabulary) fit one node of 80 GB cards, and the
    rendered release asks for what the sizing computes: 8 GPUs, the host memory, the KV budget, the concurrency."""
    from viasd.cluster.serve_config import parse_serve_config
    from viasd.parallel import check_shardable

    values = preset(name)
    s = preset_sizing(values)
    e = values["serve"]["pipelines"][0]["engine"]
    for lm, model in ((s["q"], e["verifier"]), (s["d"], e["drafter"])):
        count = sum(p.numel() for p in lm.model.parameters())
        assert count == pytest.approx(MODELS[Path(model).name].params, rel=0.01), model
    check_shardable(s["q"].config, NODE_GPUS)
    assert s["q"].vocab_size == s["d"].vocab_size  # cluster/pipeline.py refuses a pair that differs
    assert s["rank_gpu"] <= CARD and s["shared_gpu"] <= CARD
    docs = render(chart, values)
    res = container(pod_specs(one(docs, "RayService"))["worker"])["resources"]
    assert res["limits"][GPU] == res["requests"][GPU] == NODE_GPUS
    assert res["limits"]["memory"] == res["requests"]["memory"] == f"{s['host_gib']}Gi"
    config = parse_serve_config(app_args(docs))
    p = config.pipelines[0]
    assert p.tp_size == NODE_GPUS and p.tp_backend == "torch" and p.engine.mask is None  # ranks read their slices
    assert NODE_GPUS * p.verifier_cpus_per_rank + p.drafter_cpus + config.ray.replica_num_cpus <= float(
        res["limits"]["cpu"]
    )  # the placement group's CPUs fit the pod (Ray's num-cpus)
    assert p.engine.kv_cache_gib == s["budget_gib"] and p.engine.max_context >= REQUEST
    assert p.engine.max_batch == s["requests"][p.engine.cache_policy.value] == config.limits.max_concurrent_requests
    assert config.autoscaling.target_ongoing_requests <= config.limits.max_concurrent_requests


def test_docs_gpu_sizing_table_is_the_presets_arithmetic():
    text = (ROOT / "docs" / "KUBERNETES.md").read_text()
    assert sizing_mismatches(text) == []
    # a number changed in the table is caught
    line = next(line for line in text.splitlines() if line.startswith("| concurrent 4k requests"))
    wrong = re.sub(r"\| (\d+)", lambda m: f"| {int(m.group(1)) + 1}", line, count=1)
    assert wrong != line and sizing_mismatches(text.replace(line, wrong))
    # the model shapes the docs list are the ones computed with
    shapes = re.findall(r"^\| `([^`]+)` \| (\d+) \| (\d+) × (\d+) \| ([\d,]+) \| ([\d.e]+) \|$", text, re.M)
    assert {name for name, *_ in shapes} == set(MODELS)
    for name, layers, kv_heads, head_dim, vocab, params in shapes:
        s = MODELS[name]
        assert (int(layers), int(kv_heads), int(head_dim), int(vocab.replace(",", "")), float(params)) == (
            s.layers,
            s.kv_heads,
            s.hidden // s.heads,
            s.vocab,
            s.params,
        ), name


@pytest.mark.parametrize("http_port,grpc_port,route", [(8000, 9000, "/"), (8100, 9100, "/llm")])
def test_ports_and_probes_follow_the_serving_config(chart, http_port, grpc_port, route):
    v = preset("values-qwen-72b.yaml")
    v["serve"]["http"] = {"port": http_port, "route_prefix": route}
    v["serve"]["grpc"] = {"enabled": True, "port": grpc_port}
    docs = render(chart, v)
    rs = one(docs, "RayService")
    args = app_args(docs)
    assert (args["http"]["port"], args["grpc"]["port"]) == (http_port, grpc_port)
    scv2 = serve_config_v2(docs)
    assert scv2["http_options"]["port"] == http_port and scv2["grpc_options"]["port"] == grpc_port
    assert scv2["applications"][0]["route_prefix"] == route
    svc_ports = {p["name"]: p["targetPort"] for p in rs["spec"]["serveService"]["spec"]["ports"]}
    assert svc_ports == {"http": http_port, "grpc": grpc_port}
    for node, template in pod_specs(rs).items():
        c = container(template)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["serve"] == http_port and ports["serve-grpc"] == grpc_port
        live, ready = c["livenessProbe"]["exec"]["command"], c["readinessProbe"]["exec"]["command"]
        assert live[:3] == ["python", "/etc/viasd/probe/probe.py", "live"] and live[-1] == node
        if node == "worker":  # the model, through the pod's own Serve proxies
            assert ready[2] == "ready"
            opts = dict(zip(ready[3::2], ready[4::2]))
            assert opts == {
                "--node": "worker",
                "--http-port": str(http_port),
                "--grpc-port": str(grpc_port),
                "--route": route,
                "--app": args["app_name"],
            }
        else:  # KubeRay deploys the application only once the head is ready: Ray's checks alone
            assert ready[2] == "live"
    np_ports = {
        p["port"] for rule in one(docs, "NetworkPolicy")["spec"]["ingress"] if "from" not in rule for p in rule["ports"]
    }
    assert np_ports == {http_port, grpc_port}


def test_grpc_disabled_drops_grpc_everywhere(chart):
    v = preset("values-cpu-demo.yaml")
    v["serve"]["grpc"] = {"enabled": False, "port": 9000}
    docs = render(chart, v)
    rs = one(docs, "RayService")
    assert "grpc_options" not in serve_config_v2(docs)
    assert [p["name"] for p in rs["spec"]["serveService"]["spec"]["ports"]] == ["http"]
    worker = container(pod_specs(rs)["worker"])
    assert "serve-grpc" not in {p["name"] for p in worker["ports"]}
    ready = worker["readinessProbe"]["exec"]["command"]
    assert ready[ready.index("--grpc-port") + 1] == "0"


@pytest.mark.parametrize("lo,hi,initial", [(1, 4, None), (0, 6, 2), (3, 3, None)])
def test_autoscaling_bounds_reach_serve_and_the_worker_group(chart, lo, hi, initial):
    v = preset("values-llama2-70b.yaml")
    v["serve"]["autoscaling"] = {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": 7}
    if initial is not None:
        v["serve"]["autoscaling"]["initial_replicas"] = initial
    docs = render(chart, v)
    rc = one(docs, "RayService")["spec"]["rayClusterConfig"]
    assert rc["enableInTreeAutoscaling"] is True
    (group,) = rc["workerGroupSpecs"]
    assert (group["minReplicas"], group["maxReplicas"]) == (lo, hi)
    assert group["replicas"] == (lo if initial is None else initial)
    auto = app_args(docs)["autoscaling"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (lo, hi, 7)


def test_values_schema_refuses_what_the_chart_cannot_serve(chart):
    base = preset("values-llama2-70b.yaml")
    two = copy.deepcopy(base)
    two["serve"]["pipelines"].append({**two["serve"]["pipelines"][0], "name": "other"})
    bad = [
        two,  # one pipeline per release
        merged(base, {"serve": {"autoscaling": {"max_replicas": 0}}}),
        merged(base, {"serve": {"unknown_field": 1}}),
        merged(base, {"modelStorage": {"type": "objectStore", "objectStore": {"uri": ""}}}),
        merged(base, {"podSecurityContext": {"runAsNonRoot": False}}),
    ]
    render(chart, base)  # the preset itself renders
    for values in bad:
        with pytest.raises(helm.HelmValuesError):
            chart.render(values, name="rel")


# ---------------------------------------------------------------- secrets, security, storage, mask


SENTINEL = "s3cr3t-VALUE-never-rendered"


@pytest.mark.parametrize(
    "values, ports",
    [
        ({}, "HTTP 8000 and gRPC 9000"),
        ({"serve": {"http": {"port": 8080}, "grpc": {"port": 9090}}}, "HTTP 8080 and gRPC 9090"),
        ({"serve": {"grpc": {"enabled": False}}}, "HTTP 8000"),
    ],
    ids=["defaults", "other-ports", "http-only"],
)
def test_auth_chart_refuses_public_ports_without_a_token(chart, values, ports):
    """Should refuse to render when no token protects the Service's ports and anonymity is not asked for."""
    with pytest.raises(Exception, match=f"auth.tokenSecret.name: the Service exposes {ports} without authentication"):
        render(chart, values, auth=None)
    with pytest.raises(Exception, match="allowAnonymous"):
        render(chart, merged(values, {"auth": {"allowAnonymous": False}}), auth=None)


def test_auth_allow_anonymous_renders_without_a_token(chart):
    """Should render open ports when auth.allowAnonymous is true, with no token in any pod."""
    docs = render(chart, {"auth": {"allowAnonymous": True}}, auth=None)
    for template in pod_specs(one(docs, "RayService")).values():
        assert "VIASD_API_TOKEN" not in {e["name"] for e in container(template)["env"]}
    with pytest.raises(helm.HelmValuesError):  # a boolean, not a string that reads as one
        render(chart, {"auth": {"allowAnonymous": "yes"}}, auth=None)


def test_auth_a_token_file_or_secret_is_enough_and_must_be_read(chart):
    """Should render with serve.http.token_file alone (a mounted file) and refuse a tokenSecret that
    the serve config would not read (token_env pointing elsewhere)."""
    docs = render(chart, {"serve": {"http": {"token_file": "/etc/viasd/token/token"}}}, auth=None)
    assert app_args(docs)["http"]["token_file"] == "/etc/viasd/token/token"
    with pytest.raises(Exception, match="serve.http.token_env: OTHER would not read the token"):
        render(chart, {"serve": {"http": {"token_env": "OTHER"}}})
    with pytest.raises(Exception, match="auth.tokenSecret.name"):
        render(chart, {"serve": {"http": {"token_env": None}}}, auth=None)


def test_secrets_are_referenced_never_inlined(chart):
    refs = helm.parse_set_string(
        "auth.tokenSecret.name=viasd-api-token,auth.tokenSecret.key=token,tls.secretName=viasd-tls,"
        "modelStorage.objectStore.credentialsSecret=model-store-credentials"
    )
    docs = render(chart, merged(preset("values-qwen-72b.yaml"), refs))
    text = yaml.safe_dump_all(docs)
    assert SENTINEL not in text and "Secret" not in {d["kind"] for d in docs}
    rs = one(docs, "RayService")
    for template in pod_specs(rs).values():
        env = {e["name"]: e for e in container(template)["env"]}
        assert env["VIASD_API_TOKEN"] == {
            "name": "VIASD_API_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "viasd-api-token", "key": "token"}},
        }
        assert {"name": "tls", "secret": {"secretName": "viasd-tls", "defaultMode": 0o440}} in template["spec"][
            "volumes"
        ]
    (init,) = pod_specs(rs)["worker"]["spec"]["initContainers"]
    assert init["envFrom"] == [{"secretRef": {"name": "model-store-credentials"}}]
    # a secret value given to the chart the way --set gives it is refused by values.schema.json
    for expr in [
        f"auth.token={SENTINEL}",
        f"tls.key={SENTINEL}",
        f"tls.crt={SENTINEL}",
        f"modelStorage.objectStore.accessKey={SENTINEL}",
        f"extraEnv[0].name=HF_TOKEN,extraEnv[0].value={SENTINEL}",
    ]:
        with pytest.raises(helm.HelmValuesError):
            chart.render(merged(preset("values-qwen-72b.yaml"), helm.parse_set_string(expr)), name="rel")


def test_internal_tls_secret_is_mounted_and_named_in_the_pipeline(chart):
    docs = render(chart, everything())
    (pipeline,) = app_args(docs)["pipelines"]
    assert pipeline["internal_tls"] == {
        "cert_file": "/etc/viasd/internal-tls/tls.crt",
        "key_file": "/etc/viasd/internal-tls/tls.key",
        "ca_file": "/etc/viasd/internal-tls/ca.crt",
    }
    from viasd.cluster.serve_config import parse_serve_config

    assert parse_serve_config(app_args(docs)).pipelines[0].internal_tls.server_name == "viasd-internal"
    for template in pod_specs(one(docs, "RayService")).values():
        assert {"name": "internal-tls", "mountPath": "/etc/viasd/internal-tls", "readOnly": True} in container(
            template
        )["volumeMounts"]
        assert {
            "name": "internal-tls",
            "secret": {"secretName": "viasd-internal-tls", "defaultMode": 0o440},
        } in template["spec"]["volumes"]
    assert "internal_tls" not in app_args(render(chart, preset("values-qwen-72b.yaml")))["pipelines"][0]


def test_pods_run_as_non_root(chart):
    rs = one(render(chart, preset("values-llama2-70b.yaml")), "RayService")
    for template in pod_specs(rs).values():
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        assert template["spec"]["securityContext"]["runAsUser"] != 0
        sc = container(template)["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]["allowPrivilegeEscalation"] is False


def test_pods_drain_their_replicas_before_they_stop(chart):
    """preStop: the head drains the whole cluster, a worker its own node, for the serving config's
    drain timeout; a grace period too short for it is refused at render time."""
    for values, timeout in (
        (preset("values-llama2-70b.yaml"), "30"),
        (merged(preset("values-llama2-70b.yaml"), {"serve": {"limits": {"drain_timeout_s": 0}}}), "0"),
        ({"serve": {"limits": {"drain_timeout_s": 120}}, "terminationGracePeriodSeconds": 135}, "120"),
    ):
        rs = one(render(chart, values), "RayService")
        for node, template in pod_specs(rs).items():
            command = container(template)["lifecycle"]["preStop"]["exec"]["command"]
            assert command[:4] == ["python", "-m", "viasd.cli", "drain"]
            args = command[4:]
            assert args[args.index("--timeout-s") + 1] == timeout
            assert ("--this-node" in args) == (node == "worker")
            assert template["spec"]["terminationGracePeriodSeconds"] >= float(timeout) + 15
    # the command parses with the CLI's own parser
    from viasd.cli import build_parser

    args = build_parser().parse_args(command[3:])
    assert args.func.__name__ == "cmd_drain" and args.this_node
    with pytest.raises(Exception, match="terminationGracePeriodSeconds"):
        render(chart, {"serve": {"limits": {"drain_timeout_s": 60}}, "terminationGracePeriodSeconds": 60})
    render(chart, {"serve": {"limits": {"drain_timeout_s": 45}}, "terminationGracePeriodSeconds": 60})  # 45 + 15 fits


def test_model_storage_pvc_and_object_store(chart):
    docs = render(chart, preset("values-llama2-70b.yaml"))  # existing claim: mounted read-only, none created
    assert "PersistentVolumeClaim" not in {d["kind"] for d in docs}
    worker = pod_specs(one(docs, "RayService"))["worker"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "llama2-weights", "readOnly": True}} in worker[
        "spec"
    ]["volumes"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(worker)["volumeMounts"]
    args = app_args(docs)
    assert args["pipelines"][0]["engine"]["verifier"].startswith("/models/")
    created = render(chart, merged(preset("values-llama2-70b.yaml"), {"modelStorage": {"pvc": {"existingClaim": ""}}}))
    pvc = one(created, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]
    docs = render(chart, preset("values-qwen-72b.yaml"))  # object store: an init step fills an emptyDir
    worker = pod_specs(one(docs, "RayService"))["worker"]
    (init,) = worker["spec"]["initContainers"]
    env = {e["name"]: e["value"] for e in init["env"]}
    assert env == {"MODEL_URI": "s3://my-bucket/models/qwen2.5-72b", "MODEL_DIR": "/models"}
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    assert "initContainers" not in pod_specs(one(docs, "RayService"))["head"]["spec"]


def test_mask_artifact_becomes_a_configmap_and_the_verifier_mask(chart, tmp_path):
    from viasd.cluster.serve_config import parse_serve_config
    from viasd.errors import MaskError
    from viasd.llm import load_mask
    from viasd.runtime import LayerMask

    path = ROOT / "viasd" / "masks" / "qwen2.5-coder-1.5b-instruct-r0.45.json"
    artifact = path.read_text()
    docs = render(chart, merged(preset("values-cpu-demo.yaml"), {"mask": {"artifact": artifact}}))
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert cms["rel-via-sd-mask"]["data"]["mask.json"] == artifact
    engine = parse_serve_config(app_args(docs)).pipelines[0].engine
    assert engine.mask == "/etc/viasd/mask/mask.json"  # the mounted artifact, fingerprint-checked on load
    for template in pod_specs(one(docs, "RayService")).values():
        assert {"name": "mask", "mountPath": "/etc/viasd/mask", "readOnly": True} in container(template)["volumeMounts"]
    # what the workers will load from that path: the artifact's mask, refused for other weights
    data = json.loads(artifact)
    mounted = tmp_path / "mask.json"
    mounted.write_text(cms["rel-via-sd-mask"]["data"]["mask.json"])
    assert load_mask(str(mounted), data["num_layers"]) == LayerMask.from_skipped(
        data["skipped_layers"], data["num_layers"]
    )
    with pytest.raises(MaskError):
        load_mask(str(mounted), data["num_layers"] + 1)


# ---------------------------------------------------------------- NetworkPolicy, PodDisruptionBudget, metrics


def kuberay_pod_labels(template: dict, node: str) -> dict:
    """Labels a pod of this template carries once KubeRay has created it."""
    return {**template["metadata"]["labels"], "ray.io/node-type": node, "ray.io/cluster": "rel-via-sd-raycluster-x"}


def test_network_policy_selects_the_release_pods_and_keeps_internal_ports_inside(chart):
    docs = render(chart, preset("values-llama2-70b.yaml"))
    other = render(chart, preset("values-llama2-70b.yaml"), release="other")
    pol = one(docs, "NetworkPolicy")["spec"]
    ours = {n: kuberay_pod_labels(t, n) for n, t in pod_specs(one(docs, "RayService")).items()}
    theirs = {n: kuberay_pod_labels(t, n) for n, t in pod_specs(one(other, "RayService")).items()}
    assert pol["policyTypes"] == ["Ingress"]
    assert all(matches(pol["podSelector"], labels) for labels in ours.values())
    assert not any(matches(pol["podSelector"], labels) for labels in theirs.values())
    internal, *rest = pol["ingress"]
    assert "ports" not in internal  # every port, but only from ...
    (peer,) = internal["from"]
    assert set(peer) == {"podSelector"}  # ... pods of this namespace that are
    assert all(matches(peer["podSelector"], labels) for labels in ours.values())  # this release's
    assert not any(matches(peer["podSelector"], labels) for labels in theirs.values())
    args = app_args(docs)
    for rule in rest:  # anything open beyond the release: named ports only, and only the public ones to all
        ports = {p["port"] for p in rule["ports"]}
        if "from" not in rule:
            assert ports == {args["http"]["port"], args["grpc"]["port"]}
        else:
            assert ports and all(
                p.get("namespaceSelector") is not None or p.get("podSelector") is not None for p in rule["from"]
            )


def test_pdb_selects_the_worker_pods_only(chart):
    docs = render(chart, preset("values-qwen-72b.yaml"))
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    pods = {n: kuberay_pod_labels(t, n) for n, t in pod_specs(one(docs, "RayService")).items()}
    assert matches(pdb["selector"], pods["worker"]) and not matches(pdb["selector"], pods["head"])
    assert pdb["maxUnavailable"] == 1


def test_service_monitor_scrapes_ray_metrics_of_every_pod(chart):
    docs = render(chart, merged(preset("values-llama2-70b.yaml"), {"serviceMonitor": {"enabled": True}}))
    sm = one(docs, "ServiceMonitor")
    svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-metrics"))
    assert matches(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    rs = one(docs, "RayService")
    for _node, template in pod_specs(rs).items():
        assert all(template["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())
        port = next(p for p in container(template)["ports"] if p["name"] == "metrics")["containerPort"]
        assert port == svc["spec"]["ports"][0]["targetPort"]
    rc = rs["spec"]["rayClusterConfig"]
    assert rc["headGroupSpec"]["rayStartParams"]["metrics-export-port"] == str(port)
    assert "ServiceMonitor" not in {d["kind"] for d in render(chart, preset("values-llama2-70b.yaml"))}


def test_grafana_dashboard_is_a_configmap_off_by_default_reading_only_exported_series(chart):
    """The dashboard ConfigMap renders only when asked, with the sidecar's label, and every series
    its queries read is one the serving layer exports through Ray (`ray_viasd_` + a SPECS name)."""
    import re

    from viasd.cluster.serving_metrics import SPECS

    assert not [d for d in render(chart) if d["kind"] == "ConfigMap" and "grafana" in d["metadata"]["name"]]
    docs = render(chart, {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}})
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "grafana" in d["metadata"]["name"]]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == "monitoring"
    dashboard = json.loads(cm["data"]["via-sd.json"])
    exported = {"ray_viasd_" + s.name + {"counter": "_total", "histogram": "_bucket"}.get(s.kind, "") for s in SPECS}
    labels = {label for s in SPECS for label in s.labels} | {"le"}
    read = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            read |= set(re.findall(r"ray_viasd_\w+", target["expr"]))
            for group in re.findall(r"by \(([^)]*)\)", target["expr"]):
                assert {g.strip() for g in group.split(",")} <= labels, target["expr"]
    assert read and read <= exported, read - exported
    assert {
        "ray_viasd_kv_cache_usage_perc",
        "ray_viasd_request_queue_time_seconds_bucket",
        "ray_viasd_spec_decode_num_drafts_total",
    } <= read


def test_service_monitor_can_rename_the_series_to_vllms(chart):
    values = merged(preset("values-llama2-70b.yaml"), {"serviceMonitor": {"enabled": True, "vllmNames": True}})
    (relabel,) = one(render(chart, values), "ServiceMonitor")["spec"]["endpoints"][0]["metricRelabelings"]
    assert relabel["replacement"] == "vllm:$1" and relabel["regex"] == "(?:ray_)?viasd_(.*)"
    plain = merged(preset("values-llama2-70b.yaml"), {"serviceMonitor": {"enabled": True}})
    assert "metricRelabelings" not in one(render(chart, plain), "ServiceMonitor")["spec"]["endpoints"][0]


# ---------------------------------------------------------------- the probe script, against fake servers


class _Fake(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, str]] = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        status, body = self.routes.get(self.path, (404, "not found"))
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def _stop(server: http.server.HTTPServer) -> None:
    server.shutdown()
    server.server_close()


def _http_server(routes: dict) -> tuple[http.server.HTTPServer, int]:
    handler = type("Handler", (_Fake,), {"routes": routes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _grpc_server(ok: bool, seen: list) -> tuple[grpc.Server, int]:
    def list_models(request, context):
        seen.append(dict(context.invocation_metadata()))
        if not ok:
            context.abort(grpc.StatusCode.UNAVAILABLE, "pipeline down")
        return b""

    handler = grpc.method_handlers_generic_handler(
        "viasd.v1.GenerationService",
        {
            "ListModels": grpc.unary_unary_rpc_method_handler(
                list_models, request_deserializer=None, response_serializer=None
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture(scope="module")
def probe(chart, tmp_path_factory):
    """probe.py as the pods get it: from the rendered ConfigMap."""
    cm = next(d for d in render(chart) if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-probe"))
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(cm["data"]["probe.py"])
    spec = importlib.util.spec_from_file_location("viasd_chart_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_live_checks_ray_on_the_pod(probe):
    ok, agent = _http_server({"/api/local_raylet_healthz": (200, "success"), "/api/gcs_healthz": (200, "success")})
    bad, bad_agent = _http_server({"/api/local_raylet_healthz": (503, "raylet down")})
    try:
        assert probe.main(["live", "--node", "worker", "--agent-port", str(agent)]) == 0
        assert probe.main(["live", "--node", "head", "--agent-port", str(agent), "--dashboard-port", str(agent)]) == 0
        assert probe.main(["live", "--node", "worker", "--agent-port", str(bad_agent)]) == 1
        assert (
            probe.main(["live", "--node", "head", "--agent-port", str(agent), "--dashboard-port", str(bad_agent)]) == 1
        )  # GCS not answering
    finally:
        _stop(ok)
        _stop(bad)


@pytest.mark.parametrize("health,grpc_ok,expected", [(200, True, 0), (503, True, 1), (200, False, 1)])
def test_probe_ready_exercises_the_model_through_both_proxies(probe, health, grpc_ok, expected):
    ray, agent = _http_server({"/api/local_raylet_healthz": (200, "success")})
    proxy, http_port = _http_server({"/llm/health": (health, '{"status": "..."}')})
    seen: list = []
    gserver, grpc_port = _grpc_server(grpc_ok, seen)
    try:
        rc = probe.main(
            [
                "ready",
                "--node",
                "worker",
                "--agent-port",
                str(agent),
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                "--route",
                "/llm",
                "--app",
                "viasd",
                "--timeout",
                "3",
            ]
        )
        assert rc == expected
        if health == 200:
            assert seen and seen[0].get("application") == "viasd"  # Serve's proxy routes by this key
    finally:
        _stop(ray)
        _stop(proxy)
        gserver.stop(None)


def test_probe_ready_without_a_proxy_on_the_pod_checks_ray_only(probe):
    ray, agent = _http_server({"/api/local_raylet_healthz": (200, "success")})
    closed, port = _http_server({})
    _stop(closed)  # nothing listens on `port` now
    try:
        assert (
            probe.main(
                ["ready", "--node", "worker", "--agent-port", str(agent), "--http-port", str(port), "--timeout", "2"]
            )
            == 0
        )
    finally:
        _stop(ray)


# ---------------------------------------------------------------- image and cluster launcher


def test_dockerfile_installs_with_the_ci_script_as_non_root():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "bash scripts/setup.sh" in ci
    assert re.search(
        r'^\s*&& EXTRAS=serve TORCH_INDEX_URL="\$TORCH_INDEX_URL" bash scripts/setup.sh "\$MODELS"', dockerfile, re.M
    )
    assert "pip install" not in dockerfile and "==" not in dockerfile  # versions come from constraints.txt
    assert "-c constraints.txt" in setup and "EXTRAS:-dev" in setup  # CI's install (no EXTRAS): [dev], pinned
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")


def test_chart_ray_version_matches_the_pinned_ray():
    constraints = (ROOT / "constraints.txt").read_text()
    ray_pin = re.search(r"^ray==([\d.]+)$", constraints, re.M).group(1)
    assert yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"] == ray_pin
    from importlib.metadata import version

    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"] == version("via-sd")


def test_ray_cluster_launcher_config_is_valid_for_ray():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    prepared = prepare_config(config)  # what `ray up` does first
    validate_config(prepared)  # Ray's ray-schema.json and its checks
    assert prepared["provider"]["type"] == "local"
    (node_type,) = prepared["available_node_types"].values()
    assert node_type["max_workers"] == len(config["provider"]["worker_ips"])
    assert any("--num-gpus=0" in c for c in config["head_start_ray_commands"])
    with pytest.raises(jsonschema.ValidationError):
        validate_config({**prepared, "max_worker": 3})
