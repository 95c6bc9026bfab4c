"""What-if scenarios: :class:`Scenario` (every option of a simulation), its scenario files
(TOML or JSON, the same keys as the command line's flags) and the command-line options.

Every field of :class:`Scenario` is one option: the key ``round_wait_ms`` in a scenario file is
the flag ``--round-wait-ms``. Each field's metadata names its group (for ``--help``), its kind
(how a value is parsed) and its help text.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.batching import ROUND_PERIOD_MS, ROUND_WAIT_MS
from ..core.config import LeaseConfig
from ..errors import ConfigurationError

__all__ = ["Scenario", "ScenarioError", "ARRIVAL_PATTERNS", "JOB_DURATIONS", "LEASE_MODES", "LIMITED_GROUPS",
           "CHOICES", "NO_VALUE", "GROUPS", "RANGES", "CSV_COLUMNS",
           "load_scenario", "read_arrivals_csv", "save_scenario", "add_options", "scenario_from_args"]

#: Arrival patterns (``arrivals`` is a list of them; they add up).
ARRIVAL_PATTERNS = ("steady", "bursty", "diurnal", "backlog", "csv")
#: Job duration distributions (``job_duration``).
JOB_DURATIONS = ("fixed", "exponential", "lognormal")
#: Lease modes (``leases``; or a JSON object of the holder's ``leases=`` options).
LEASE_MODES = ("off", "strict", "under", "over")
#: ``limited_groups`` values (the holder's ``limitedGroups``).
LIMITED_GROUPS = ("exclude", "withinGroupLimit")
#: The valid values of each choice-valued option, named in its error message.
CHOICES: dict[str, str] = {
    "leases": "off, strict, under, over, or a JSON object of the holder's leases= options (provisioning, "
              "permitsPerLease, ttlMs, limitedGroups, reusable, leaseFirst, recheckMs)",
    "job_duration": ", ".join(JOB_DURATIONS),
    "arrivals": "a comma-separated list of " + ", ".join(ARRIVAL_PATTERNS),
    "limited_groups": ", ".join(LIMITED_GROUPS),
    "arrivals_csv": "the path of an existing CSV file (needed with the csv arrival pattern)",
    "group_limits": "group=N,group=N with N an integer >= 0",
}
#: The columns of an arrivals CSV: the required ones, then the optional ones.
CSV_COLUMNS = (("at_ms", "client"), ("group", "duration_ms"))
#: Lease options that only one mode uses (the others, every mode).
_MODE_ONLY = {"reserve": "under", "extra_ratio": "over", "extra_count": "over"}
#: Options whose value may be "no value" (the value standing for it): written as ``null`` to JSON
#: and ``"none"`` to TOML (which has no null) by :func:`save_scenario`, and read back from either.
#: ``admit_concurrency``'s no value means no bound.
NO_VALUE: dict[str, Any] = {"extra_count": None, "admit_concurrency": None, "group_limits": {}, "arrivals_csv": ""}
#: Option groups, in ``--help`` order: (name, title).
GROUPS = (
    ("run", "run"),
    ("holder", "holder (DurabilitySemaphore)"),
    ("leases", "leases (the holder's leases= options)"),
    ("queue", "queue (SemaphoreQueue options of every client object)"),
    ("clients", "client objects and groups"),
    ("arrivals", "arrivals"),
    ("jobs", "job durations"),
    ("faults", "faults"),
)


class ScenarioError(ValueError):
    """An invalid scenario: an unknown key, a value of the wrong type or out of range
    (the message names the key)."""


def _opt(default: Any, group: str, kind: str, help: str) -> Any:
    metadata = {"group": group, "kind": kind, "help": help}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _dict_opt(group: str, kind: str, help: str) -> Any:
    return field(default_factory=dict, metadata={"group": group, "kind": kind, "help": help})


@dataclass
class Scenario:
    """One what-if setup: the holder's limits and rounds, leases, queue options, client
    objects, traffic, job durations, run length, seed and faults. Defaults are the simulator's
    default scenario. Build one directly, from a mapping (:meth:`from_mapping`), a file
    (:func:`load_scenario`) or command-line arguments (:func:`scenario_from_args`)."""

    # run
    seed: int = _opt(1, "run", "int", "random seed: the same seed gives the same run, number for number")
    run_s: float = _opt(600.0, "run", "float", "virtual seconds simulated (arrivals stop at the end)")
    sample_ms: int = _opt(1000, "run", "int", "interval of the time series (CSV rows, plot points), virtual ms")
    # holder
    limit: int = _opt(20, "holder", "int", "the shared limit (permits running at once across all client objects)")
    group_limits: dict[str, int] = _dict_opt(
        "holder", "groups", "per-group ceilings, e.g. g0=3,g1=5 (file: a table {g0 = 3}), of groups g0.. "
                            "or of the arrivals CSV; groups absent have none")
    round_wait_ms: int = _opt(ROUND_WAIT_MS, "holder", "int",
                              "under contention, a round runs this long after its first waiting request")
    round_period_ms: int = _opt(ROUND_PERIOD_MS, "holder", "int",
                                "...but never sooner than this after the previous such round")
    grant_timeout_ms: int = _opt(10_000, "holder", "int", "unclaimed grant permits are reclaimed after this")
    free_at_once: bool = _opt(True, "holder", "bool",
                              "while nothing competes, a request's round runs at once (free means now, SPEC R9a)")
    hold_blocked_ms: int = _opt(0, "holder", "int",
                                "hold a request its round cannot serve open this long (0: off; the queue's "
                                "request_wait_ms too)")
    # leases
    leases: Any = _opt("strict", "leases", "leases",
                       "off, strict, under or over (with the options below), or a JSON object of the holder's "
                       "leases= options (file: a table) used as it is")
    permits_per_lease: int = _opt(64, "leases", "int", "most permits one lease carries (permitsPerLease)")
    lease_ttl_ms: int = _opt(1_800_000, "leases", "int", "a lease unreported this long is retired (ttlMs)")
    reserve: int = _opt(0, "leases", "int", "under: permits of the limit kept for leases")
    extra_ratio: float = _opt(0.25, "leases", "float", "over: leases may go floor(limit * ratio) above the limit")
    extra_count: int | None = _opt(None, "leases", "optint", "over: a fixed count above the limit instead of the ratio")
    limited_groups: str = _opt("exclude", "leases", "str", "exclude or withinGroupLimit (limitedGroups)")
    reusable: bool = _opt(True, "leases", "bool",
                          "lease slots are reused while the lease lives (reusable, SPEC R34a)")
    lease_first: bool = _opt(True, "leases", "bool",
                             "size leases before grants in a round (leaseFirst, SPEC R28a)")
    lease_recheck_ms: int = _opt(30_000, "leases", "int",
                                 "a client draws from a lease only while its last reply is younger than this;"
                                 " else it syncs first (recheckMs, SPEC R33a; 0: off)")
    # queue
    report_releases_within_ms: int = _opt(10_000, "queue", "int",
                                          "a sync is sent for releases once the oldest waited this long")
    prefer_leases: bool = _opt(True, "queue", "bool", "draw from live leases before claiming grants")
    request_wait_ms: int = _opt(0, "queue", "int", "how long a request waits for an answer (waitMs; 0: off)")
    admit_concurrency: int | None = _opt(1000, "queue", "optint",
                                         "items of a key admitted at once per client object (none: no bound)")
    retry_ms: int = _opt(1000, "queue", "int", "wait before contacting the holder again after a failure")
    claim_margin_ms: int = _opt(500, "queue", "int", "do not claim from a grant this close to its claimBy")
    lease_margin_ms: int = _opt(1000, "queue", "int", "do not draw from a lease this close to its expiry")
    # clients and groups
    clients: int = _opt(8, "clients", "int",
                        "client objects (each a SemaphoreClient + scheduler + SemaphoreQueue on its own SQLite)")
    groups: int = _opt(2, "clients", "int", "distinct groups g0, g1, ... shared by the client objects")
    groups_per_client: int = _opt(1, "clients", "int",
                                  "groups each client object uses: client i uses g(i), g(i+1), ... (mod groups)")
    # arrivals
    arrivals: list[str] = _opt(["bursty", "backlog"], "arrivals", "list",
                               "patterns, comma-separated, adding up: steady, bursty, diurnal, backlog, csv")
    rate_per_s: float = _opt(0.5, "arrivals", "float",
                             "steady and diurnal: mean arrivals per second per client object (Poisson)")
    burst_size: int = _opt(8, "arrivals", "int", "bursty: items per burst")
    burst_every_s: float = _opt(60.0, "arrivals", "float",
                                "bursty: a burst every this many seconds per client object (random phase)")
    burst_span_ms: int = _opt(2000, "arrivals", "int", "bursty: a burst's items arrive spread over this span")
    diurnal_period_s: float = _opt(240.0, "arrivals", "float", "diurnal: period of the sinusoid")
    diurnal_amplitude: float = _opt(0.9, "arrivals", "float",
                                    "diurnal: rate(t) = rate * (1 + amplitude * sin(2 pi t / period)), 0..1")
    backlog: int = _opt(3, "arrivals", "int",
                        "backlog: items each backlog client keeps queued (a new one as one starts)")
    backlog_clients: int = _opt(2, "arrivals", "int",
                                "backlog: how many client objects (the first ones) keep a backlog; 0: all")
    arrivals_csv: str = _opt("", "arrivals", "str",
                             "csv: a file of arrivals with columns at_ms,client and optionally group,duration_ms "
                             "(client: index or name c0..; group missing or empty: the client's first; duration_ms "
                             "missing or empty: drawn from the job duration options)")
    # jobs
    job_duration: str = _opt("exponential", "jobs", "str", "fixed, exponential or lognormal (a CSV's duration_ms wins)")
    job_ms: float = _opt(8000.0, "jobs", "float", "fixed: the duration; exponential: the mean (ms)")
    job_mu: float = _opt(8.5, "jobs", "float", "lognormal: mu of ln(duration in ms)")
    job_sigma: float = _opt(0.6, "jobs", "float", "lognormal: sigma of ln(duration in ms)")
    # faults
    lose_request: float = _opt(0.0, "faults", "float",
                               "probability a message is lost (half of them delivered late instead)")
    lose_reply: float = _opt(0.0, "faults", "float", "probability a reply is lost (the message was delivered)")
    duplicate: float = _opt(0.0, "faults", "float", "probability a message is delivered twice")
    delay: float = _opt(0.0, "faults", "float", "probability a message or a reply is delayed (1..max_delay_ms)")
    max_delay_ms: int = _opt(3000, "faults", "int", "longest delay of a late or delayed message")
    evict_client_p: float = _opt(0.0, "faults", "float",
                                 "probability, every fault interval, that a random client object is evicted")
    evict_holder_p: float = _opt(0.0, "faults", "float",
                                 "probability, every fault interval, that the holder object is evicted")
    fault_interval_ms: int = _opt(1000, "faults", "int", "how often eviction is rolled")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], base: Scenario | None = None) -> Scenario:
        """A scenario from a mapping of option keys (a parsed scenario file), on top of
        ``base`` (default: the default scenario). Raises :class:`ScenarioError`."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ScenarioError(f"unknown scenario keys: {', '.join(unknown)}")
        values = {name: _coerce(name, known[name].metadata["kind"], v) for name, v in data.items()}
        scenario = dataclasses.replace(base or cls(), **values)
        scenario.validate()
        return scenario

    def to_mapping(self) -> dict[str, Any]:
        """Every option as plain data, an option without a value (:data:`NO_VALUE`) as ``None``:
        what a JSON scenario file holds (``null``)."""
        return {k: None if k in NO_VALUE and v == NO_VALUE[k] else v for k, v in dataclasses.asdict(self).items()}

    def lease_options(self) -> dict[str, Any] | None:
        """The holder's ``leases=`` options this scenario gives (``None``: leases off)."""
        if isinstance(self.leases, dict):
            return dict(self.leases)
        if self.leases == "off":
            return None
        provisioning: dict[str, Any] = {"mode": self.leases}
        if self.leases == "under":
            provisioning["reserve"] = self.reserve
        elif self.leases == "over":
            provisioning["extra"] = ({"count": self.extra_count} if self.extra_count is not None
                                     else {"ratio": self.extra_ratio})
        options: dict[str, Any] = {"provisioning": provisioning, "permitsPerLease": self.permits_per_lease,
                                   "ttlMs": self.lease_ttl_ms, "limitedGroups": self.limited_groups,
                                   "recheckMs": self.lease_recheck_ms}
        if self.reusable:
            options["reusable"] = True
        if self.lease_first:
            options["leaseFirst"] = True
        return options

    def client_groups(self, index: int) -> list[str]:
        """The groups client object ``index`` uses."""
        return [f"g{(index + j) % self.groups}" for j in range(min(self.groups_per_client, self.groups))]

    def validate(self) -> None:
        """Raise :class:`ScenarioError` naming the first invalid option and its valid values: the
        one check of a scenario, whether it came from a file, the command line or code
        (:class:`~semaphore.simulate.engine.Simulation` runs it too). It reads the arrivals CSV
        and parses the holder's ``leases=`` options as the holder would."""
        for name, ok, valid in self._checks():
            if not ok:
                raise ScenarioError(_invalid(name, getattr(self, name), valid))
        try:
            LeaseConfig.parse(self.lease_options())
        except ConfigurationError as exc:
            raise ScenarioError(_invalid("leases", self.leases, CHOICES["leases"], why=str(exc))) from exc

    def warnings(self) -> list[str]:
        """What this scenario sets that has no effect (the command line prints each on stderr):
        more ``groups_per_client`` than ``groups`` or ``backlog_clients`` than ``clients`` (each
        is cut down to what exists), and lease options (:meth:`_idle_lease_options`). Warned
        about, not refused, so a scenario file can be rerun with ``--leases off`` or
        ``--clients 1``."""
        out = [f"warning: {name} {getattr(self, name)} is more than {what} ({count}): {effect}"
               for name, count, what, effect, used in (
                   ("groups_per_client", self.groups, "groups", "each client object uses all of them", True),
                   ("backlog_clients", self.clients, "clients", "all of them keep a backlog",
                    "backlog" in self.arrivals))
               if used and getattr(self, name) > count]
        ignored, why = self._idle_lease_options()
        if ignored:
            out.append(f"warning: {', '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with {why}")
        return out

    def _idle_lease_options(self) -> tuple[list[str], str]:
        """The lease options set to other than their defaults that have no effect, and why:
        every one while ``leases`` is off or a JSON object (used as it is), ``reserve`` outside
        ``under``, ``extra_ratio``/``extra_count`` outside ``over`` (and the ratio beside a count)."""
        defaults = type(self)()
        changed = [f.name for f in dataclasses.fields(self) if f.metadata["group"] == "leases"
                   and f.name != "leases" and getattr(self, f.name) != getattr(defaults, f.name)]
        if self.leases == "off":
            return changed, "leases off"
        if isinstance(self.leases, dict):
            return changed, "leases given as a JSON object (used as it is)"
        return [k for k in changed if _MODE_ONLY.get(k, self.leases) != self.leases
                or (k == "extra_ratio" and self.extra_count is not None)], f"leases {self.leases}"

    def _checks(self) -> Iterator[tuple[str, bool, str]]:
        """``(option, valid?, its valid values)`` in order: each option on its own (choices and
        :data:`RANGES`), then the ones that depend on others (the CSV, the group limits)."""
        choices = {"arrivals": bool(self.arrivals) and all(a in ARRIVAL_PATTERNS for a in self.arrivals),
                   "job_duration": self.job_duration in JOB_DURATIONS,
                   "leases": isinstance(self.leases, dict) or self.leases in LEASE_MODES,
                   "limited_groups": self.limited_groups in LIMITED_GROUPS}
        for f in dataclasses.fields(self):
            if f.name in choices:
                yield f.name, choices[f.name], CHOICES[f.name]
            elif f.metadata["kind"] in ("int", "optint", "float"):
                yield (f.name, *self._in_range(f.name, f.metadata["kind"]))
        csv_needed = "csv" in self.arrivals
        yield "arrivals_csv", not csv_needed or Path(self.arrivals_csv).is_file(), CHOICES["arrivals_csv"]
        groups = [f"g{i}" for i in range(self.groups)]
        shown = ", ".join(groups) if self.groups <= 4 else f"g0..g{self.groups - 1}"
        if csv_needed:
            csv_groups = sorted({group for _, _, group, _ in read_arrivals_csv(self)} - set(groups))
            groups += csv_groups
            shown += "".join(f", {g}" for g in csv_groups[:8]) + (", ..." if len(csv_groups) > 8 else "")
        limits = self.group_limits
        yield ("group_limits", isinstance(limits, dict) and all(
                   g in groups and _is_int(n) and n >= 0 for g, n in limits.items()),
               f"{CHOICES['group_limits']} and group one of {shown}")

    def _in_range(self, name: str, kind: str) -> tuple[bool, str]:
        """Whether numeric option ``name`` is in its :data:`RANGES` (and finite), and that range
        in words, e.g. ``an integer >= 1``, ``a finite number in 0..1``."""
        value = getattr(self, name)
        noun = "a finite number" if kind == "float" else "an integer"
        rule = RANGES.get(name)
        if rule is None:
            return _is_number(value, kind), noun
        match = _RULE.fullmatch(rule)
        assert match is not None, rule
        op, low, first, high, rest = match.groups()
        if op:
            text = f"{noun} {op} {low}{rest}"
            ok = _is_number(value, kind) and (value >= float(low) if op == ">=" else value > float(low))
        else:
            text = f"{noun} in {first}..{high}{rest}"
            ok = _is_number(value, kind) and float(first) <= value <= float(high)
        if kind == "optint" and name in NO_VALUE:
            ok = ok or value is None
        return ok, text


#: The valid range of each numeric option but ``seed`` and ``job_mu`` (any finite value),
#: named in its error message: ``>= N``, ``> N`` or ``N..M``; the rest of the text is shown as
#: it is. A float option must also be finite. The lowest values are the library's own (below
#: them it raises :class:`~semaphore.errors.ConfigurationError`).
RANGES: dict[str, str] = {
    "run_s": "> 0", "sample_ms": ">= 1", "limit": ">= 0", "round_wait_ms": ">= 0", "round_period_ms": ">= 0",
    "grant_timeout_ms": ">= 1", "hold_blocked_ms": ">= 0", "permits_per_lease": ">= 1", "lease_ttl_ms": ">= 1",
    "reserve": ">= 0", "extra_ratio": ">= 0", "extra_count": ">= 0, or none: the ratio",
    "lease_recheck_ms": ">= 0", "report_releases_within_ms": ">= 0", "request_wait_ms": ">= 0",
    "admit_concurrency": ">= 1, or none: no bound", "retry_ms": ">= 1", "claim_margin_ms": ">= 0",
    "lease_margin_ms": ">= 0", "clients": ">= 1", "groups": ">= 1", "groups_per_client": ">= 1",
    "rate_per_s": ">= 0", "burst_size": ">= 0", "burst_every_s": "> 0", "burst_span_ms": ">= 0",
    "diurnal_period_s": "> 0", "diurnal_amplitude": "0..1", "backlog": ">= 0",
    "backlog_clients": ">= 0; 0: all", "job_ms": "> 0", "job_sigma": ">= 0",
    "lose_request": "0..1", "lose_reply": "0..1", "duplicate": "0..1", "delay": "0..1", "max_delay_ms": ">= 1",
    "evict_client_p": "0..1", "evict_holder_p": "0..1", "fault_interval_ms": ">= 1",
}
_RULE = re.compile(r"(?:(>=|>) (\d+)|(\d+)\.\.(\d+))(.*)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any, kind: str) -> bool:
    """``value`` is an int (``int``, ``optint``) or a finite number (``float``)."""
    if kind != "float":
        return _is_int(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _invalid(name: str, value: Any, valid: str | None = None, *, why: str = "") -> str:
    """The error message of an invalid option: its name, the value, why (if said) and the valid
    values (default: its :data:`CHOICES`)."""
    valid = valid or CHOICES.get(name)
    said = "; ".join(x for x in (why, f"valid: {valid}" if valid else "") if x)
    return f"invalid {name}: {value!r}" + (f" ({said})" if said else "")


# ---------------------------------------------------------------------------------- arrivals CSV
def read_arrivals_csv(scenario: Scenario) -> list[tuple[int, int, str, int | None]]:
    """The rows of ``scenario.arrivals_csv`` as ``(at_ms, client index, group, duration_ms or
    None)``. Its header names the columns (:data:`CSV_COLUMNS`): ``at_ms`` and ``client`` (an
    index or a name ``c<index>``) are required; ``group`` (missing or empty: the client's first
    group) and ``duration_ms`` (missing or empty: drawn from the job duration options) are
    optional. Raises :class:`ScenarioError` naming the file, line and column."""
    path = scenario.arrivals_csv
    required, optional = CSV_COLUMNS
    valid = f"a header of {','.join(required)} and optionally {','.join(optional)}"
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = [c.strip() for c in reader.fieldnames or []]
            for what, names in (("missing", [c for c in required if c not in columns]),
                                ("unknown", [c for c in columns if c not in required + optional])):
                if names:
                    raise ScenarioError(f"invalid arrivals_csv: {path}: {what} column{'s' * (len(names) > 1)} "
                                        f"{', '.join(names)} (valid: {valid})")
            reader.fieldnames = columns
            return [_csv_row(scenario, n, row) for n, row in enumerate(reader, 2)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ScenarioError(f"invalid arrivals_csv: {path}: {exc} (valid: {CHOICES['arrivals_csv']})") from exc


def _csv_row(scenario: Scenario, n: int, row: Mapping[str | None, Any]) -> tuple[int, int, str, int | None]:
    """Line ``n`` of the arrivals CSV (see :func:`read_arrivals_csv`)."""
    def cell(column: str) -> str:
        return str(row.get(column) or "").strip()

    def bad(column: str, valid: str) -> ScenarioError:
        return ScenarioError(f"invalid arrivals_csv: {scenario.arrivals_csv}:{n}: {column} {cell(column)!r} "
                             f"(valid: {valid})")

    last = scenario.clients - 1
    client = cell("client").removeprefix("c")
    if not (client.isdigit() and int(client) <= last):
        raise bad("client", f"an index in 0..{last} or a name c0..c{last}")
    at_ms, duration = _ms(cell("at_ms")), _ms(cell("duration_ms"))
    if at_ms is None:
        raise bad("at_ms", "a finite number of ms >= 0")
    if duration is None and cell("duration_ms"):
        raise bad("duration_ms", "a finite number of ms >= 0, or empty: drawn from the job duration options")
    group = cell("group") or scenario.client_groups(int(client))[0]
    return int(at_ms), int(client), group, None if duration is None else max(1, int(duration))


def _ms(text: str) -> float | None:
    """``text`` as a finite number >= 0 (``None``: not one)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _coerce(name: str, kind: str, value: Any) -> Any:
    """``value`` (from a file or a flag) as the option's type; raises :class:`ScenarioError`.
    ``null`` or ``"none"`` of an option that may have no value (:data:`NO_VALUE`) is that."""
    if name in NO_VALUE and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", ""))):
        return NO_VALUE[name]
    try:
        if kind == "int":
            return _int(value)
        if kind == "optint":
            return None if value is None or str(value).lower() in ("none", "") else _int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            return {"true": True, "false": False, "1": True, "0": False}[str(value).lower()]
        if kind == "str":
            return str(value)
        if kind == "list":
            items = value.split(",") if isinstance(value, str) else list(value)
            return [str(x).strip() for x in items if str(x).strip()]
        if kind == "groups":
            return _groups(value)
        return _leases(value)
    except (TypeError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ScenarioError(_invalid(name, value)) from exc


def _int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError
    return int(value)


def _groups(value: Any) -> dict[str, int]:
    if isinstance(value, str):
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
        return {k.strip(): _int(v) for k, v in pairs}
    if not isinstance(value, Mapping):
        raise TypeError
    return {str(k): _int(v) for k, v in value.items()}


def _leases(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    text = str(value).strip()
    if text.startswith("{"):
        parsed = json.loads(text)
        if not isinstance(parsed, dict):
            raise TypeError
        return parsed
    if text not in LEASE_MODES:
        raise ValueError
    return text


# ---------------------------------------------------------------------------------- files
def load_scenario(path: str | Path, base: Scenario | None = None) -> Scenario:
    """Read a scenario file: TOML (``.toml``, via :mod:`tomllib`) or JSON (any other suffix),
    a flat table of option keys; options it leaves out keep ``base``'s (default: the default
    scenario's)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ScenarioError(f"invalid scenario: {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ScenarioError(f"invalid scenario: {path}: not a table (valid: one table of option keys)")
    return Scenario.from_mapping(data, base)


def save_scenario(scenario: Scenario, path: str | Path) -> None:
    """Write ``scenario`` as a scenario file: TOML for ``.toml``, else JSON. An option without a
    value (:data:`NO_VALUE`) is ``null`` in JSON and ``"none"`` in TOML, which has no null.
    Reading the file back with :func:`load_scenario` gives an equal scenario."""
    path = Path(path)
    data = scenario.to_mapping()
    if path.suffix.lower() == ".toml":
        text = "".join(f"{_toml_key(k)} = {_toml_value('none' if v is None else v)}\n" for k, v in data.items())
    else:
        text = json.dumps(data, indent=2) + "\n"
    path.write_text(text, encoding="utf-8")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise ScenarioError(f"cannot write {value!r} to TOML")


# ---------------------------------------------------------------------------------- command line
def add_options(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`Scenario` option to ``parser``, grouped as :data:`GROUPS`.
    Flags default to "not given" (so a scenario file's values stay unless overridden)."""
    sections = {name: parser.add_argument_group(title) for name, title in GROUPS}
    defaults = Scenario()
    for f in dataclasses.fields(Scenario):
        flag = "--" + f.name.replace("_", "-")
        kind, default = f.metadata["kind"], getattr(defaults, f.name)
        shown = (",".join(default) if isinstance(default, list) else str(default).lower() if kind == "bool"
                 else default)
        text = f"{f.metadata['help']} (key {f.name}; default: {shown if shown not in ({}, '') else 'none'})"
        section = sections[f.metadata["group"]]
        if kind == "bool":
            section.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                 default=argparse.SUPPRESS, help=text)
        else:
            section.add_argument(flag, dest=f.name, default=argparse.SUPPRESS, metavar=kind.upper(),
                                 help=text.replace("%", "%%"))


def scenario_from_args(args: argparse.Namespace, base: Scenario | None = None) -> Scenario:
    """The scenario of parsed arguments: ``base`` with every option flag given applied."""
    names = {f.name for f in dataclasses.fields(Scenario)}
    given = {k: v for k, v in vars(args).items() if k in names}
    return Scenario.from_mapping(given, base)
