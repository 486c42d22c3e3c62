"""The metrics reference (docs/reference/metrics.md), written by docs/generate.py: the loader's
Prometheus collectors as registered, and the vLLM connector's series as prom.py declares them."""
from __future__ import annotations

import ast
from pathlib import Path

from docs.page_parts import HEADER, cell as _cell, code as _code

REPO = Path(__file__).resolve().parents[1]


def _loader_series() -> list[tuple[str, str, str, str]]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics import MetricWrapperBase

    from store.serving.metrics import LoaderMetrics
    from store.tiers.stats import StoreStats

    registry = CollectorRegistry()
    metrics = LoaderMetrics(registry, tenant="t", store=StoreStats())
    declared = {c._name: list(c._labelnames) for c in vars(metrics).values() if isinstance(c, MetricWrapperBase)}
    out = []
    for family in registry.collect():
        labels: list[str] = declared.get(family.name, [])
        for s in family.samples:
            labels += [k for k in s.labels if k != "le" and k not in labels]
        suffix = "_total" if family.type == "counter" else ""
        out.append((family.name + suffix, family.type, ", ".join(_code(k) for k in labels), family.documentation))
    return out


def _connector_tables() -> tuple[str, dict[str, str], dict[str, tuple[str, tuple[str, ...]]], tuple[str, str]]:
    """``PREFIX``, ``COUNTERS``, ``LABELLED`` and the histogram's name and help, read from prom.py's source."""
    from store.miss import MissReason

    tree = ast.parse((REPO / "store" / "engines" / "vllm" / "prom.py").read_text(encoding="utf-8"))
    names = {"MISS_REASONS": tuple(r.value for r in MissReason)}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id in ("PREFIX", "COUNTERS", "LABELLED"):
            names[target.id] = eval(compile(ast.Expression(node.value), "prom.py", "eval"), {"__builtins__": {}}, names)
    hist = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_histogram_cls":
            kw = {k.arg: eval(compile(ast.Expression(k.value), "prom.py", "eval"), {"__builtins__": {}}, names)
                  for k in node.keywords if k.arg in ("name", "documentation")}
            hist = (kw["name"], kw["documentation"])
    if hist is None:
        raise RuntimeError("store/engines/vllm/prom.py: no histogram found; update docs/generate.py")
    return names["PREFIX"], names["COUNTERS"], names["LABELLED"], hist


def _node_section() -> list[str]:
    """The node process's series (store/node/metrics.py)."""
    from store.node.metrics import COUNTERS, GAUGES, WRITE_BACK

    lines = ["## The node process (`prefill node`)", "",
             "On the node's own endpoint, `http://HOST:PORT/metrics` (`node.metrics_port`;",
             "[the node guide](../guides/node.md)).", "",
             "| series | type | labels | help |", "|---|---|---|---|"]
    lines += [f"| `kvwarm_node_{n}_total` | counter | | {_cell(h)} |" for n, h in COUNTERS.items()]
    lines += ["| `kvwarm_node_copies_total` | counter | `outcome` | Copies from the shared tier into the node tier, "
              "by outcome (`copied`, `present`, `absent`, `expired`, `mismatch`, `refused`, `unavailable`, "
              "`write_failed`, `bad_name`, `superseded`). |"]
    lines += [f"| `kvwarm_node_{n}_total` | counter | {'`reason`' if n.endswith('_dropped') else ''} | {_cell(h)} |"
              for n, h in WRITE_BACK.items()]
    lines += [f"| `kvwarm_node_{n}` | gauge | | {_cell(h)} |" for n, h in GAUGES.items()]
    lines += ["| `kvwarm_node_info` | gauge | `fingerprint`, `node_id`, `version` | The node's kvwarm version and "
              "store settings' fingerprint (always 1). |"]
    return lines


def metrics_md() -> str:
    from store.miss import MissReason
    from store.serving.metrics import LATENCY_BUCKETS, STAGES

    lines = ["# Metrics reference", "",
             "Prometheus series kvwarm exposes, with their type, labels and help text. Counters are",
             "scraped with the `_total` suffix; the histograms add `_bucket`, `_sum` and `_count`.", "",
             "## The loader (`KVLoader`)", "",
             "Registered in the loader's own registry (`loader.metrics.registry`), or in the one",
             "passed as `KVLoader(..., registry=prometheus_client.REGISTRY)`. `tenant` is the loader's",
             "tenant; the pool gauges are node-wide. `loader.stats()` reads the same figures back as a",
             "dict ([the loader guide](../guides/loader.md#metrics)).", "",
             "| series | type | labels | help |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {t} | {lab} | {_cell(h)} |" for n, t, lab, h in _loader_series()]
    lines += ["", "Label values:", "",
              "- `reason`: " + ", ".join(_code(r.value) for r in MissReason)
              + " ([what each means](../guides/loader.md#never-fail-the-request));",
              "- `stage`: " + ", ".join(_code(s) for s in STAGES) + ";",
              "- `outcome` (prefetch): `present`, `fetched`, `mapped`;",
              "- histogram buckets (seconds): " + ", ".join(str(b) for b in LATENCY_BUCKETS) + ".", ""]
    prefix, counters, labelled, (hist_name, hist_help) = _connector_tables()
    lines += ["## The vLLM connector (`KvwarmConnector`)", "",
              "On vLLM's own `/metrics` (the API server's), fed from the connector's stats every",
              "interval. Every series has vLLM's labels `model_name` and `engine`.", "",
              "| series | type | labels | help |", "|---|---|---|---|"]
    lines += [f"| `{prefix}{n}_total` | counter | | {_cell(h)} |" for n, h in counters.items()]
    lines += [f"| `{prefix}{n}_total` | counter | `reason` | {_cell(h)} |" for n, (h, _) in labelled.items()]
    lines += [f"| `{hist_name}` | histogram | | {_cell(hist_help)} |", "", "`reason` values created at start:", ""]
    lines += [f"- `{prefix}{n}_total`: " + ", ".join(_code(r) for r in reasons) + ";" for n, (_, reasons) in
              labelled.items()]
    lines[-1] = lines[-1].rstrip(";") + "."
    lines += ["", *_node_section()]
    return HEADER.format(source="store/serving/metrics.py, store/engines/vllm/prom.py and store/node/metrics.py") + "\n".join(lines) + "\n"
