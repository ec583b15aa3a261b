"""``disaggregatedset-rollout-screener``, sans-IO: llm-d-router's DisaggregatedSet rollout screener
(``requestcontrol/screener/disaggregatedsetrollout``).

Before every scheduling profile it narrows the candidates:

- revision gating (``revisionGating.mode`` ``sum`` or ``max-role``): from the Ready pods in
  ``scope.labelSelector`` (its pod notifications, :meth:`RolloutScreener.apply`; the reference's
  ``disaggregatedset-rollout-pod-extractor``), a revision missing a Ready pod of any
  ``requireRoles`` role is dropped, and unless a strict header pins the request one covered revision
  is drawn, weighted by its Ready pods summed over the roles (``sum``) or counted in the role with
  the most Ready pods over all covered revisions (``max-role``); only its endpoints stay. No pod
  seen yet: no revision is covered, every request fails closed (503), as the reference's.
- strict ``headerSelectors``: a request header keeps the endpoints whose ``labelKey`` label equals
  it (none matching: 503, counted in ``..._strict_header_no_match_total``).

After scheduling, each selector's ``headerName`` is set on the response to the chosen endpoint's
``labelKey`` label. The metrics are read at scrape (:class:`RolloutCollector`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from evergreen_trio.picker.checks import sequence
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, LabelSelector, Params, PluginType, register

ROLLOUT_SCREENER = "disaggregatedset-rollout-screener"
POD_EXTRACTOR = "disaggregatedset-rollout-pod-extractor"  # the reference's name for its pod notifications
DEFAULT_REVISION_LABEL = "disaggregatedset.x-k8s.io/revision"
DEFAULT_ROLE_LABEL = "disaggregatedset.x-k8s.io/role"
GATING_MODES = ("sum", "max-role", "disabled")
MAX_PODS = 65_536  # pods tracked per screener: a scope matching more is a mistake, not a deployment
T = TypeVar("T")
MAX_LABEL_VALUE = 63  # a Kubernetes label value's length; a longer one from the API server is not a revision


# -- Kubernetes label selectors (labels.Parse) ---------------------------------------------------

_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_SET = re.compile(r"^(\S+)\s+(in|notin)\s*\(([^()]*)\)$")


def parse_label_selector(text: str, where: str) -> LabelSelector:
    """A selector in Kubernetes' string form (``a=b,c!=d,e in (f,g),h notin (i),j,!k``); an empty
    one matches everything. ConfigError naming ``where`` otherwise."""
    expressions: list[tuple[str, str, frozenset[str]]] = []
    for term in _terms(text, where):
        found = _SET.match(term)
        if found:
            key, operator, values = found[1], "In" if found[2] == "in" else "NotIn", found[3].split(",")
        elif term.startswith("!"):
            key, operator, values = term[1:].strip(), "DoesNotExist", []
        elif "!=" in term or "=" in term:
            key, sep, value = term.partition("!=") if "!=" in term else term.partition("==" if "==" in term else "=")
            key, operator, values = key.strip(), "NotIn" if sep == "!=" else "In", [value]
        else:
            key, operator, values = term, "Exists", []
        values = [v.strip() for v in values]
        if not _KEY.match(key) or not all(_VALUE.match(v) for v in values) or (operator in ("In", "NotIn")
                                                                               and not values):
            raise ConfigError(where, "a Kubernetes label selector (key=value, key!=value, key in (a,b), "
                                     "key notin (a), key, !key; comma separated)", text)
        expressions.append((key, operator, frozenset(values)))
    return LabelSelector((), tuple(expressions))


def _terms(text: str, where: str) -> Iterator[str]:
    """The comma-separated terms of a selector, commas inside parentheses kept."""
    depth, start = 0, 0
    for i, char in enumerate(text + ","):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ConfigError(where, "a Kubernetes label selector", text)
        if char == "," and depth == 0:
            term = text[start:i].strip()
            if term:
                yield term
            elif text.strip():
                raise ConfigError(where, "a Kubernetes label selector (no empty term)", text)
            start = i + 1


def selector_terms(selector: LabelSelector) -> dict[str, Any]:
    """``selector`` as lightkube's ``labels`` (what the API server filters the watch by): one
    requirement per key, the first; the screener checks the whole selector on every pod anyway."""
    from lightkube import operators  # the picker extra: only a cluster-mode watch asks

    make: Mapping[str, Callable[[frozenset[str]], Any]] = {  # one value: k=v and k!=v, as it was likely written
        "In": lambda values: operators.equal(*values) if len(values) == 1 else operators.in_(values),
        "NotIn": lambda values: operators.not_equal(*values) if len(values) == 1 else operators.not_in(values),
        "Exists": lambda values: operators.exists(), "DoesNotExist": lambda values: operators.not_exists()}
    terms: dict[str, Any] = {}
    for key, operator, values in selector.expressions:
        terms.setdefault(key, make[operator](values))
    return terms


# -- the parameters (config.go) -------------------------------------------------------------------


@dataclass(frozen=True)
class HeaderSelector:
    """One header <-> label pair: ``strict`` narrows the candidates; both modes stamp the response."""

    name: str
    header: str  # lower case, as the reference stores it
    label: str
    strict: bool


@dataclass(frozen=True)
class RolloutParams:
    """The screener's parameters; ``require_roles`` empty means gating is off (``disabled``)."""

    scope: LabelSelector
    scope_text: str
    selectors: tuple[HeaderSelector, ...] = ()
    mode: str = "disabled"
    revision_label: str = DEFAULT_REVISION_LABEL
    role_label: str = DEFAULT_ROLE_LABEL
    require_roles: tuple[str, ...] = ()

    @property
    def gating(self) -> bool:
        """Whether revision gating runs (and so whether pods are watched)."""
        return self.mode != "disabled"


def _header_selector(raw: object, path: str) -> HeaderSelector:
    entry = Params(raw, path, "headerSelectors", ("name", "headerName", "labelKey", "mode"))
    values = {key: entry.text(key, "") for key in ("name", "headerName", "labelKey")}
    for key, value in values.items():
        if not value:
            raise ConfigError(entry.where(key), "a non-empty string (required)", value)
    mode = entry.text("mode", "", choices=("strict", "prefer"))
    return HeaderSelector(values["name"], values["headerName"].lower(), values["labelKey"], mode == "strict")


def _rollout(params: Params) -> RolloutParams:
    scope_text = params.section("scope", ("labelSelector",)).text("labelSelector", "")
    where = params.where("scope.labelSelector")
    if not scope_text:
        raise ConfigError(where, "a label selector (required)", scope_text)
    scope = parse_label_selector(scope_text, where)
    selectors: list[HeaderSelector] = []
    for i, raw in enumerate(sequence(params.raw.get("headerSelectors") or [], params.where("headerSelectors"))):
        selector = _header_selector(raw, params.where(f"headerSelectors[{i}]"))
        for other in selectors:
            for key, mine, theirs in (("name", selector.name, other.name),
                                      ("headerName", selector.header, other.header)):
                if mine == theirs:
                    raise ConfigError(params.where(f"headerSelectors[{i}].{key}"), "a value no selector used before",
                                      mine)
        selectors.append(selector)
    if params.raw.get("revisionGating") is None:
        raise ConfigError(params.where("revisionGating"), "a revisionGating section (required)", None)
    gating = params.section("revisionGating", ("revisionLabelKey", "roleLabelKey", "mode", "requireRoles"))
    mode = gating.text("mode", "", choices=GATING_MODES)
    roles: list[str] = []
    if mode != "disabled":
        if gating.raw.get("requireRoles") is None:
            raise ConfigError(gating.where("requireRoles"), f"requireRoles (required when mode={mode})", None)
        require = gating.section("requireRoles", ("values",))
        listed = sequence(require.raw.get("values") or [], require.where("values"))
        if not listed:
            raise ConfigError(require.where("values"), "at least one role", listed)
        for i, role in enumerate(listed):
            if not isinstance(role, str) or not role or role in roles:
                raise ConfigError(require.where(f"values[{i}]"), "a non-empty role not listed before", role)
            roles.append(role)
    return RolloutParams(scope, scope_text, tuple(selectors), mode,
                         gating.text("revisionLabelKey", "") or DEFAULT_REVISION_LABEL,
                         gating.text("roleLabelKey", "") or DEFAULT_ROLE_LABEL, tuple(roles))


def _required(params: Params) -> RolloutParams:
    if not params.raw:
        raise ConfigError(params.path, f"{ROLLOUT_SCREENER} parameters (scope, revisionGating)", None)
    return _rollout(params)


register(ROLLOUT_SCREENER, PluginType(Category.OTHER, ("scope", "headerSelectors", "revisionGating"), _required))


# -- the distribution (plugin.go) -----------------------------------------------------------------


def sum_weight(per_role: Mapping[str, int], required: Sequence[str]) -> int | None:
    """A revision's Ready pods summed over the required roles; None when one has none."""
    if any(per_role.get(role, 0) == 0 for role in required):
        return None
    return sum(per_role[role] for role in required)


def dominant_role(covered: Mapping[str, Mapping[str, int]], required: Sequence[str]) -> str:
    """The required role with the most Ready pods over the covered revisions (the first on a tie)."""
    best, best_count = "", -1
    for role in required:
        total = sum(per_role.get(role, 0) for per_role in covered.values())
        if total > best_count:
            best, best_count = role, total
    return best


def revision_shares(role_counts: Mapping[str, Mapping[str, int]], required: Sequence[str],
                    mode: str) -> dict[str, float]:
    """Each covered revision's share of traffic (they sum to 1; an uncovered revision has none)."""
    covered = {rev: per_role for rev, per_role in role_counts.items() if sum_weight(per_role, required) is not None}
    if mode == "max-role":
        role = dominant_role(covered, required)
        weights = {rev: per_role.get(role, 0) for rev, per_role in covered.items()}
    else:
        weights = {rev: sum_weight(per_role, required) or 0 for rev, per_role in covered.items()}
    total = sum(weights.values())
    return {rev: weight / total for rev, weight in weights.items()} if total > 0 else {}


def pick_revision(shares: Mapping[str, float], draw: float) -> str:
    """The revision ``draw`` (in [0, 1)) lands on, revisions in name order; "" when none has a share."""
    total = sum(shares.values())
    if total == 0:
        return ""
    revisions = sorted(shares)
    target, cumulative = draw * total, 0.0
    for revision in revisions:
        cumulative += shares[revision]
        if target < cumulative:
            return revision
    return revisions[-1]


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    """IsPodReady: not being deleted, and the first Ready condition is True."""
    metadata, status = pod.get("metadata"), pod.get("status")
    if not isinstance(metadata, Mapping) or metadata.get("deletionTimestamp"):
        return False
    conditions = status.get("conditions") if isinstance(status, Mapping) else None
    for condition in conditions if isinstance(conditions, list) else ():
        if isinstance(condition, Mapping) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def _labels(pod: Mapping[str, Any]) -> dict[str, str]:
    metadata = pod.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    if not isinstance(labels, Mapping):
        return {}
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


def _key(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    metadata = pod.get("metadata")
    if not isinstance(metadata, Mapping):
        return None
    name, namespace = metadata.get("name"), metadata.get("namespace", "")
    return (namespace, name) if isinstance(name, str) and name and isinstance(namespace, str) else None


@dataclass
class RolloutScreener:
    """One declared screener: the Ready pods it was told of (by revision and role), their shares,
    and its counts for the metrics. ``name`` is the plugin's name."""

    params: RolloutParams
    name: str = ROLLOUT_SCREENER
    pods: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    role_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    no_match: dict[str, int] = field(default_factory=dict)  # strict selector name -> requests it failed

    # -- pod notifications (the reference's disaggregatedset-rollout-pod-extractor) --

    def apply(self, event_type: str, pod: object) -> None:
        """One Pod notification (ADDED, MODIFIED, DELETED; anything else is ignored). A pod not
        Ready, out of scope or without both labels is forgotten; a malformed one is ignored."""
        if not isinstance(pod, Mapping) or event_type not in ("ADDED", "MODIFIED", "DELETED"):
            return
        key = _key(pod)
        if key is None:
            return
        info = self._accepted(pod) if event_type != "DELETED" else None
        if info is None:
            if self.pods.pop(key, None) is not None:
                self._rebuild()
            return
        if key not in self.pods and len(self.pods) >= MAX_PODS:
            return
        if self.pods.get(key) != info:
            self.pods[key] = info
            self._rebuild()

    def replace(self, pods: Iterable[object]) -> None:
        """A fresh list of the pods in scope: forget every pod not in it."""
        self.pods = {}
        for pod in pods:
            if isinstance(pod, Mapping) and (key := _key(pod)) is not None and len(self.pods) < MAX_PODS:
                info = self._accepted(pod)
                if info is not None:
                    self.pods[key] = info
        self._rebuild()

    def _accepted(self, pod: Mapping[str, Any]) -> tuple[str, str] | None:
        params = self.params
        labels = _labels(pod)
        if not params.gating or not params.scope.keeps(labels) or not _pod_ready(pod):
            return None
        revision, role = labels.get(params.revision_label, ""), labels.get(params.role_label, "")
        if not revision or not role or len(revision) > MAX_LABEL_VALUE or len(role) > MAX_LABEL_VALUE:
            return None
        return revision, role

    def _rebuild(self) -> None:
        counts: dict[str, dict[str, int]] = {}
        for revision, role in self.pods.values():
            per_role = counts.setdefault(revision, {})
            per_role[role] = per_role.get(role, 0) + 1
        self.role_counts = counts
        self.shares = revision_shares(counts, self.params.require_roles, self.params.mode)

    # -- the request path --

    def screen(self, headers: Mapping[str, str], candidates: Sequence[T], labels: Callable[[T], Mapping[str, str]],
               draw: Callable[[], float]) -> list[T]:
        """The candidates the request with ``headers`` keeps (empty: fail closed); ``labels`` reads
        a candidate's labels, ``draw`` gives a number in [0, 1)."""
        params = self.params
        kept = list(candidates)
        if params.gating:
            revision = params.revision_label
            seen = {labels(c).get(revision, "") for c in kept} - {""}
            allowed = {r for r in seen if self.shares.get(r, 0.0) > 0}
            strict = any(s.strict and headers.get(s.header) for s in params.selectors)
            chosen = "" if strict else pick_revision({r: self.shares[r] for r in allowed}, draw())
            kept = [c for c in kept if (labels(c).get(revision, "") == chosen if chosen
                                        else labels(c).get(revision, "") in allowed)]
            if not kept:
                return []
        for selector in params.selectors:
            requested = headers.get(selector.header, "") if selector.strict else ""
            if not requested:
                continue
            kept = [c for c in kept if labels(c).get(selector.label) == requested]
            if not kept:
                self.no_match[selector.name] = self.no_match.get(selector.name, 0) + 1
                return []
        return kept

    def response_headers(self, labels: Mapping[str, str]) -> dict[str, str]:
        """What the response to a request served by an endpoint with ``labels`` gets."""
        return {s.header: labels[s.label] for s in self.params.selectors if labels.get(s.label)}


def rollout_screeners(params_by_name: Mapping[str, object]) -> list[RolloutScreener]:
    """A screener for each declared ``disaggregatedset-rollout-screener`` (name -> params)."""
    return [RolloutScreener(p, name) for name, p in params_by_name.items() if isinstance(p, RolloutParams)]


class RolloutCollector(Collector):
    """``llm_d_epp_disaggregatedset_strict_header_no_match_total`` and
    ``llm_d_epp_disaggregatedset_revision_gating_share``, read from the screeners at scrape."""

    def __init__(self, screeners: Sequence[RolloutScreener]) -> None:
        self.screeners = screeners

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        no_match = CounterMetricFamily(
            "llm_d_epp_disaggregatedset_strict_header_no_match",
            "[ALPHA] Strict header selections that matched no endpoint and failed closed.",
            labels=["plugin_type", "plugin_name", "selector"])
        share = GaugeMetricFamily(
            "llm_d_epp_disaggregatedset_revision_gating_share",
            "[ALPHA] Current weighted revision gating share from 0 to 1; incomplete revisions have share 0.",
            labels=["plugin_type", "plugin_name", "mode", "revision"])
        for screener in self.screeners:
            for selector, count in screener.no_match.items():
                no_match.add_metric([ROLLOUT_SCREENER, screener.name, selector], count)
            for revision in screener.role_counts:
                share.add_metric([ROLLOUT_SCREENER, screener.name, screener.params.mode, revision],
                                 screener.shares.get(revision, 0.0))
        yield no_match
        yield share
