"""The monitoring contract, checked against a real Prometheus through its HTTP API.

Every expression of the Grafana dashboard and of the rule files must parse, and every metric it
names must be one the scraped targets expose (or a recording rule makes): Prometheus answers an
empty vector, not an error, for a metric that does not exist, so a renamed metric would leave a
panel blank without this check.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "pdproxy.json"
RULES_DIR = MONITORING / "prometheus" / "rules"

GRAFANA_VARIABLES = {"$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "15s"}
"""Grafana's built-in variables, as Grafana would fill them in; any other ``$name`` is an error."""

_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
     "group_right", "inf", "nan", "Inf", "NaN", "atan2", "start", "end"}
)  # fmt: skip
_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True, slots=True)
class Expression:
    where: str
    """``panel 'Title'`` or ``rule 'name'``: where an operator would look for it."""
    expr: str


def dashboard_expressions(path: Path = DASHBOARD) -> list[Expression]:
    doc = json.loads(path.read_text())
    out: list[Expression] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                if "expr" in target:
                    out.append(Expression(f"panel {panel['title']!r}", target["expr"]))

    walk(doc["panels"])
    return out


def rule_expressions(rules_dir: Path = RULES_DIR) -> list[Expression]:
    out: list[Expression] = []
    for path in sorted(rules_dir.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("record") or rule["alert"]
                out.append(Expression(f"rule {name!r}", rule["expr"]))
    return out


def recorded_names(rules_dir: Path = RULES_DIR) -> set[str]:
    names = set()
    for path in sorted(rules_dir.glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names |= {r["record"] for r in group["rules"] if "record" in r}
    return names


def fill_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    unknown = re.findall(r"\$\{?\w+", expr)
    if unknown:
        raise ValueError(f"dashboard variable(s) {unknown} are not defined")
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (functions, keywords, labels left out)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("("):
            continue  # a function call
        if m.group(0) not in _KEYWORDS:
            names.add(m.group(0))
    return names


class Prometheus:
    """A Prometheus server's query API."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _get(self, path: str, **params: str) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        if body.get("status") != "success":
            raise QueryFailed(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self._get("/api/v1/query", query=expr)
        result = data["result"]
        return result if isinstance(result, list) else [result]

    def known_metrics(self) -> set[str]:
        """Names with samples now, plus every family the targets describe (HELP/TYPE), so a
        labelled counter that has not counted anything yet still counts as existing."""
        names = set(self._get("/api/v1/label/__name__/values"))
        names |= set(self._get("/api/v1/metadata"))
        return names

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets")["activeTargets"])

    def rule_health(self) -> dict[str, str]:
        groups = self._get("/api/v1/rules")["groups"]
        return {r["name"]: r["health"] for g in groups for r in g["rules"]}


class QueryFailed(Exception):
    """Prometheus refused a query (it does not parse, or cannot be evaluated)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    expression: Expression
    problem: str | None
    series: int


def check(prom: Prometheus, expressions: list[Expression], extra_names: set[str]) -> list[Verdict]:
    """Evaluate each expression: a problem if it does not parse or names an unknown metric."""
    known = prom.known_metrics() | extra_names
    verdicts = []
    for e in expressions:
        try:
            expr = fill_variables(e.expr)
            series = len(prom.query(expr))
        except (ValueError, QueryFailed) as exc:
            verdicts.append(Verdict(e, str(exc), 0))
            continue
        unknown = sorted(n for n in metric_names(expr) if n not in known and _base(n) not in known)
        problem = f"names metrics no target exposes: {unknown}" if unknown else None
        verdicts.append(Verdict(e, problem, series))
    return verdicts


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name
