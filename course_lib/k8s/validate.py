"""A Kubernetes training job checked offline, before a cluster sees it: four layers.

Introduced in notebooks/12_scaling_out.ipynb. A mistake in a manifest is otherwise found only
when the job is submitted, or worse when its pods start. :func:`validate` lists every problem of a
manifest (a dict from :mod:`course_lib.k8s`, or YAML text) and :func:`check` raises them:

1. :func:`yaml_problems`: the YAML text reads back as the same plain JSON-like data;
2. :func:`pod_problems`: every pod template against Kubernetes' own OpenAPI schema for
   ``v1/PodTemplateSpec``, as shipped by the ``kubernetes-validate`` package;
3. :func:`crd_problems`: the whole job against its operator's CRD schema, unknown fields
   rejected as ``kubectl apply``'s strict field validation does (the schemas and their sources
   are in ``course_lib/k8s/schemas/``);
4. ``k8s_rules.rule_problems``: what the operators' webhooks and controllers require and no
   schema says.

YAML text is read as ``kubectl apply -f`` reads it: a stream of documents separated by ``---``,
the empty ones (nothing, or only comments) skipped. :func:`validate`, :func:`check` and
:func:`load` take one manifest; :func:`validate_all` and :func:`load_all` take a whole file.
It stays one file: the four layers are read in order, and they share the JSON-schema plumbing.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from importlib import resources
from typing import Any

import yaml

from course_lib.k8s import (
    K8S_VERSION,
    KINDS,
    REPLICA_SPECS,
    SCHEMA_FILES,
    ManifestError,
    Problem,
    field_path,
    kind_of,
    label_of,
    lookup,
    to_yaml,
)
from course_lib.k8s.rules import rule_problems

# Kubernetes' quantity grammar (apimachinery resource.Quantity), as controller-gen writes it into
# every CRD. Kubernetes' own OpenAPI document says only "string or number" and leaves the grammar
# to the API server, so layer 2 adds it (see _registry).
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_QUANTITY = re.compile(QUANTITY_PATTERN)
_DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"


# --------------------------------------------------------------------------- layer 1: YAML


def _plain_problems(value, where, label):
    """Values that JSON (what the API server receives) cannot carry: YAML dates, byte strings,
    sets, non-string keys."""
    if isinstance(value, dict):
        out = []
        for key, item in value.items():
            if not isinstance(key, str):
                out.append(Problem(label, "yaml", field_path(*where),
                                   f"key {key!r} is a {type(key).__name__}, not a string"))
            out += _plain_problems(item, (*where, str(key)), label)
        return out
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _plain_problems(item, (*where, i),
                                                                           label)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return []
    return [Problem(label, "yaml", field_path(*where),
                    f"YAML read {value!r} as a {type(value).__name__}, which JSON cannot carry: "
                    "quote it")]


def documents(text: str) -> list:
    """The documents of a YAML stream, as ``kubectl apply -f`` reads a file: separated by
    ``---``, the empty ones (nothing, or only comments) skipped. Raises yaml's ``YAMLError``.
    Introduced in notebooks/12_scaling_out.ipynb."""
    return [document for document in yaml.safe_load_all(text) if document is not None]


def _stream(text, name):
    """``(documents, problems)``: the problems when ``text`` is not valid YAML."""
    try:
        return documents(text), []
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        context = getattr(error, "context", None)
        return [], [Problem(name, "yaml", where,
                            f"not valid YAML: {problem}" + (f" ({context})" if context else ""))]


def _document_problems(data, name):
    """One document: a mapping of plain JSON values that survives a YAML round trip."""
    if not isinstance(data, dict):
        return [Problem(name, "yaml", "",
                        f"the document is a {type(data).__name__}, not a mapping")]
    label = label_of(data)
    problems = _plain_problems(data, (), label)
    if not problems and yaml.safe_load(to_yaml(data)) != data:
        problems.append(Problem(label, "yaml", "", "does not survive a YAML round trip"))
    return problems


def yaml_problems(text: str, name: str = "job.yaml") -> list[Problem]:
    """Layer 1: ``text`` holds one YAML document (empty ones skipped, as kubectl does), a
    mapping of plain JSON values, and dumping what was read and reading it back gives the same
    thing. Introduced in notebooks/12_scaling_out.ipynb."""
    found, problems = _stream(text, name)
    if problems:
        return problems
    if len(found) != 1:
        return [Problem(name, "yaml", "", f"expected one YAML document, found {len(found)} "
                        "(validate_all reads a file of several)")]
    return _document_problems(found[0], name)


def load(text: str, name: str = "job.yaml") -> dict:
    """The manifest in YAML ``text``; :class:`ManifestError` if layer 1 finds a problem.
    Introduced in notebooks/12_scaling_out.ipynb."""
    problems = yaml_problems(text, name)
    if problems:
        raise ManifestError(problems)
    return documents(text)[0]


def load_all(text: str, name: str = "job.yaml") -> list[dict]:
    """Every manifest of a YAML file (the non-empty documents of the stream), whatever its
    kind; :class:`ManifestError` if one is not valid YAML or not plain data. Introduced in
    notebooks/12_scaling_out.ipynb."""
    found, problems = _stream(text, name)
    for document in found:
        problems += _document_problems(document, name)
    if problems:
        raise ManifestError(problems)
    return found


# --------------------------------------------------------------------------- JSON schema help

# jsonschema, referencing and kubernetes-validate are imported when a manifest is first
# validated (each import below says so): importing jsonschema or kubernetes-validate takes a
# second or more, and generating a manifest needs none of them.


@functools.lru_cache(maxsize=1)
def _format_checker():
    import jsonschema  # when first validating: see above

    checker = jsonschema.FormatChecker(formats=())
    checker.checks("quantity")(lambda value: not isinstance(value, str)
                               or bool(_QUANTITY.match(value)))
    return checker


def _schema_dir(version):
    """kubernetes-validate's strict schemas (additionalProperties: false everywhere) for the
    Kubernetes minor ``version``."""
    from kubernetes_validate.utils import all_versions  # when first validating: see above

    folder = (resources.files("kubernetes_validate") / "kubernetes-json-schema"
              / f"v{version}.0-local-strict")
    if not folder.is_dir():
        raise ValueError(f"kubernetes-validate has no schemas for Kubernetes {version}: "
                         f"it ships {', '.join(all_versions())}")
    return folder


@functools.lru_cache(maxsize=4)
def _registry(version):
    from referencing import Registry, Resource  # when first validating: see above

    definitions = json.loads((_schema_dir(version) / "_definitions.json").read_text())
    quantity = "io.k8s.apimachinery.pkg.api.resource.Quantity"
    # The OpenAPI document says "string or number"; the grammar is enforced by the API server.
    definitions["$defs"][quantity] = {"type": ["string", "number", "null"], "format": "quantity"}
    return Registry().with_resource(_DEFINITIONS_URI, Resource.from_contents(definitions))


def _k8s_ref(name):
    return {"$ref": f"{_DEFINITIONS_URI}#/$defs/{name}"}


def _validator(schema, version):
    import jsonschema  # when first validating: see above

    return jsonschema.Draft202012Validator(schema, registry=_registry(version),
                                           format_checker=_format_checker())


def _error_problems(validator, instance, label, layer, prefix=()):
    from jsonschema.exceptions import best_match  # when first validating: see above

    problems = []
    for error in validator.iter_errors(instance):
        if error.validator in ("anyOf", "oneOf") and error.context:
            error = best_match(error.context)   # the branch that came closest says more
        where = (*prefix, *error.absolute_path)
        if error.validator == "additionalProperties" and error.validator_value is False \
                and isinstance(error.instance, dict):
            known = set(error.schema.get("properties", {}))
            for key in sorted(set(error.instance) - known):
                problems.append(Problem(label, layer, field_path(*where, key),
                                        "unknown field (not in the schema)"))
            continue
        message = error.message
        if (error.validator == "format" and error.validator_value == "quantity") or \
                (error.validator == "pattern" and error.validator_value == QUANTITY_PATTERN):
            message = (f"{error.instance!r} is not a Kubernetes quantity "
                       "(like 500m, 2, 1.5, 512Mi, 4Gi or 1G)")
        problems.append(Problem(label, layer, field_path(*where), message))
    return sorted(set(problems), key=lambda p: (p.path, p.message))


# --------------------------------------------------------------------------- layer 2: pods


def pod_templates(manifest: dict) -> list[tuple[tuple, dict]]:
    """``(path, template)`` for every pod template in a PyTorchJob, TFJob or MPIJob (a TrainJob
    has none: its pods come from the runtime). Introduced in notebooks/12_scaling_out.ipynb."""
    key = REPLICA_SPECS.get(kind_of(manifest))
    replicas = lookup(manifest, "spec", key) if key else None
    if not isinstance(replicas, dict):
        return []
    return [(("spec", key, rtype, "template"), spec["template"])
            for rtype, spec in replicas.items()
            if isinstance(spec, dict) and "template" in spec]


def pod_problems(manifest: dict, k8s_version: str = K8S_VERSION) -> list[Problem]:
    """Layer 2: each pod template against Kubernetes' own OpenAPI schema of
    ``io.k8s.api.core.v1.PodTemplateSpec`` (strict: unknown fields rejected) as shipped by
    ``kubernetes-validate``, quantities included; for a TrainJob, its ``resourcesPerNode`` and
    ``env`` against ``ResourceRequirements`` and ``EnvVar``. Introduced in
    notebooks/12_scaling_out.ipynb."""
    label, problems = label_of(manifest), []
    if kind_of(manifest) == "TrainJob":
        checks = [(("spec", "trainer", "resourcesPerNode"), "ResourceRequirements")]
        env = lookup(manifest, "spec", "trainer", "env")
        if isinstance(env, list):
            checks += [(("spec", "trainer", "env", i), "EnvVar") for i in range(len(env))]
        for where, type_name in checks:
            value = lookup(manifest, *where)
            if value is not None:
                validator = _validator(_k8s_ref(f"io.k8s.api.core.v1.{type_name}"), k8s_version)
                problems += _error_problems(validator, value, label, "pod", where)
        return problems
    validator = _validator(_k8s_ref("io.k8s.api.core.v1.PodTemplateSpec"), k8s_version)
    for where, template in pod_templates(manifest):
        problems += _error_problems(validator, template, label, "pod", where)
    return problems


# --------------------------------------------------------------------------- layer 3: CRD


@functools.lru_cache(maxsize=8)
def crd(kind: str) -> dict:
    """The stored CRD excerpt for ``kind``: ``group``, ``version``, ``source`` (repository, path,
    commit) and ``openAPIV3Schema``. Introduced in notebooks/12_scaling_out.ipynb."""
    if kind not in SCHEMA_FILES:
        raise ValueError(f"no CRD schema stored for kind {kind!r}: one of {', '.join(KINDS)}")
    text = (resources.files("course_lib.k8s") / "schemas" / SCHEMA_FILES[kind]).read_text()
    return yaml.safe_load(text)


def _structural(schema):
    """The API server prunes every field a structural schema does not declare; ``kubectl``'s
    strict server-side field validation (GA in Kubernetes 1.27) turns that into an error. So:
    ``additionalProperties: false`` wherever properties are listed and unknown fields are not
    explicitly preserved."""
    if isinstance(schema, list):
        for item in schema:
            _structural(item)
        return schema
    if not isinstance(schema, dict):
        return schema
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for sub in schema.get("properties", {}).values():
        _structural(sub)
    for key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
        if isinstance(schema.get(key), (dict, list)):
            _structural(schema[key])
    return schema


@functools.lru_cache(maxsize=8)
def _crd_schema(kind):
    schema = _structural(copy.deepcopy(crd(kind)["openAPIV3Schema"]))
    # Whatever the CRD says about metadata, the API server checks it as an ObjectMeta.
    schema["properties"]["metadata"] = _k8s_ref("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    schema.setdefault("required", [])
    schema["required"] = [*schema["required"], "apiVersion", "kind", "metadata", "spec"]
    return schema


def crd_problems(manifest: dict, k8s_version: str = K8S_VERSION) -> list[Problem]:
    """Layer 3: the whole job against its operator's CRD ``openAPIV3Schema`` (from
    ``course_lib/k8s/schemas/``), unknown fields rejected, ``metadata`` as an ObjectMeta.
    The CEL rules (``x-kubernetes-validations``) are not evaluated here. Introduced in
    notebooks/12_scaling_out.ipynb."""
    label, kind = label_of(manifest), kind_of(manifest)
    if kind not in SCHEMA_FILES:
        return [Problem(label, "crd", "kind",
                        f"unknown kind {kind!r}: this module knows {', '.join(KINDS)}")]
    stored = crd(kind)
    expected = f"{stored['group']}/{stored['version']}"
    if lookup(manifest, "apiVersion") != expected:
        return [Problem(label, "crd", "apiVersion",
                        f"{lookup(manifest, 'apiVersion')!r}: a {kind} here is {expected!r}")]
    validator = _validator(_crd_schema(kind), k8s_version)
    return _error_problems(validator, manifest, label, "crd")


# --------------------------------------------------------------------------- all layers


def validate(manifest: dict | str, k8s_version: str = K8S_VERSION) -> list[Problem]:
    """Every problem of a manifest (a dict, or YAML text), layer by layer: YAML, pod templates,
    CRD schema, operator rules. An empty list when the operator would accept it. A problem that
    two layers find (a pod template field is checked by both the pod and the CRD schema) is
    listed once. Introduced in notebooks/12_scaling_out.ipynb."""
    if isinstance(manifest, str):
        problems = yaml_problems(manifest)
        if problems:
            return problems
        manifest = documents(manifest)[0]
    else:
        problems = yaml_problems(to_yaml(manifest), label_of(manifest))
    problems += pod_problems(manifest, k8s_version)
    problems += crd_problems(manifest, k8s_version)
    problems += rule_problems(manifest)
    seen, unique = set(), []
    for problem in problems:
        if (problem.path, problem.message) not in seen:
            seen.add((problem.path, problem.message))
            unique.append(problem)
    return unique


def check(manifest: dict | str, k8s_version: str = K8S_VERSION) -> dict:
    """The manifest (parsed, if it was YAML text) when :func:`validate` finds nothing, else
    :class:`ManifestError` listing every problem. Introduced in
    notebooks/12_scaling_out.ipynb."""
    problems = validate(manifest, k8s_version)
    if problems:
        raise ManifestError(problems)
    return documents(manifest)[0] if isinstance(manifest, str) else manifest


def training_jobs(manifests: list[Any]) -> list[dict]:
    """The manifests (from :func:`load_all`) whose kind is one of ``k8s.KINDS``. Introduced in
    notebooks/12_scaling_out.ipynb."""
    return [m for m in manifests if kind_of(m) in KINDS]


def validate_all(text: str, name: str = "job.yaml",
                 k8s_version: str = K8S_VERSION) -> list[Problem]:
    """Every problem of every training job in a YAML file, as ``kubectl apply -f`` reads it: a
    stream of documents, the empty ones skipped. Documents of other kinds (a Service, a PVC, a
    ClusterTrainingRuntime) are passed over: kubectl applies them, but their schemas are not
    here (:func:`training_jobs` tells which were checked). Introduced in
    notebooks/12_scaling_out.ipynb."""
    found, problems = _stream(text, name)
    for document in found:
        if not isinstance(document, dict):
            problems += _document_problems(document, name)
        elif kind_of(document) in KINDS:
            problems += validate(document, k8s_version)
    return problems
