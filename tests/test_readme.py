"""The README's Python blocks run (issue 10): every fenced ```python block of README.md is run
here against the test kit, or is a file of the sample Worker (``tests/test_sample_worker.py``
checks those), or is marked as not runnable, with a reason, by a comment right before it::

    <!-- readme-test: not run: <why> -->

A new block that is none of these fails :func:`test_every_python_block_is_run_or_marked`, so
the README cannot rot. Blocks are known by the heading they stand under (:data:`RUN_BY`).

How they run: blocks that define Durable Object classes import ``workers``, so a tiny stand-in
module (:func:`workers_standin`: a ``DurableObject`` that keeps ``ctx`` and ``env``) is put in
``sys.modules`` for the test only. The blocks construct ``DurabilityScheduler(ctx)`` and
``SemaphoreClient(ctx, ...)`` with no clock (the wall clock in a Worker); :func:`clock` makes a
:class:`~semaphore.testing.SimClock` their default for the test, so rounds, claim windows and
alarms run on virtual time, and each test asserts the objects really got it. Fragments that use
names from their context (the teaser, ``async with self.queue.permit(...)``) run with top-level
``await`` in a namespace that provides those names (a small client object against a
:class:`~semaphore.testing.HolderSide`). Error tracebacks point at README.md's own lines.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import semaphore
import semaphore.client._client as client_module
import semaphore.scheduler as scheduler_module
from sample_worker import README_FILES, readme_files
from semaphore import (
    BlockedReason,
    DurabilityScheduler,
    DurabilitySemaphore,
    GrantStatus,
    ItemState,
    LeaseConfig,
    LeaseStatus,
    LimitedGroups,
    PermitKind,
    Provisioning,
    parse_message,
)
from semaphore.testing import (
    T0,
    AlarmDriver,
    Bed,
    ClientSide,
    HolderSide,
    LocalContext,
    Namespace,
    Net,
    SimClock,
    TaskAlarmDriver,
    VirtualClock,
    async_test,
)
from semaphore.testing import blocked as blocked_of

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARKER = re.compile(r"^<!--\s*readme-test:\s*not run:\s*(?P<reason>.*?)\s*-->$")

#: heading a ```python block stands under -> the test of this module that runs it.
RUN_BY = {
    "# durability-semaphore": "test_the_teaser_runs_in_a_client_object",
    "## The holder: `DurabilitySemaphore`": "test_the_holder_class_grants_under_its_limits_and_reclaims",
    "### Wire format (v1)": "test_the_wire_format_is_what_the_holder_answers",
    "## Leases": "test_the_lease_options_construct",
    "## The client side": "test_the_client_object_admits_jobs_under_the_limit",
    "### Permits: `async with queue.permit(...)`": "test_the_permit_fragment_holds_and_releases_a_permit",
}
#: heading of the sample Worker's blocks (each starts with ``# <path>``).
SAMPLE_HEADING = "### The sample"

pytestmark = pytest.mark.usefixtures("quiet_logs")


# ================================================================== the README's blocks
@dataclass(frozen=True)
class Block:
    line: int  #: README line of the first line of code (after the fence)
    lang: str
    text: str
    heading: str
    marker: str | None  #: the reason of a ``readme-test: not run`` comment right before it

    @property
    def sample_file(self) -> str | None:
        first = self.text.split("\n", 1)[0]
        return first[2:].strip() if first.startswith("# ") and first[2:].strip() in README_FILES else None


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the heading each stands under."""
    found: list[Block] = []
    heading, fence, body, start, marker, previous = "", None, [], 0, None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("```"):
                fence, body, start = line[3:].strip(), [], number + 1
                match = MARKER.match(previous.strip())
                marker = match.group("reason") if match else None
            elif line.startswith("#"):
                heading = line.strip()
            if line.strip():
                previous = line
        elif line.startswith("```"):
            found.append(Block(start, fence, "\n".join(body) + "\n", heading, marker))
            fence, previous = None, ""
        else:
            body.append(line)
    return found


def python_blocks(text: str | None = None) -> list[Block]:
    return [b for b in blocks(README.read_text(encoding="utf-8") if text is None else text) if b.lang == "python"]


def problems(found: list[Block], run_by: dict[str, str]) -> list[str]:
    """Why blocks are neither run, nor sample files, nor marked (empty: all accounted for)."""
    out = []
    for b in found:
        if b.marker is not None:
            if not b.marker:
                out.append(f"README.md:{b.line}: 'readme-test: not run' needs a reason")
        elif b.sample_file is not None:
            if b.heading != SAMPLE_HEADING:
                out.append(f"README.md:{b.line}: sample file {b.sample_file} outside {SAMPLE_HEADING!r}")
        elif b.heading not in run_by:
            out.append(f"README.md:{b.line} (under {b.heading!r}): a python block no test runs; run it in "
                       "tests/test_readme.py (RUN_BY) or mark it <!-- readme-test: not run: <why> -->")
    for heading in run_by:
        n = sum(1 for b in found if b.heading == heading and b.marker is None)
        if n != 1:
            out.append(f"{run_by[heading]} runs the python block under {heading!r}, but there are {n}")
    return out


def block(heading: str) -> Block:
    (found,) = [b for b in python_blocks() if b.heading == heading and b.marker is None]
    return found


def _compile(b: Block, tree: ast.Module) -> types.CodeType:
    ast.increment_lineno(tree, b.line - 1)  # tracebacks point at README.md's lines
    return compile(tree, str(README), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


async def run(b: Block, namespace: dict[str, Any], statements: slice = slice(None)) -> dict[str, Any]:
    """Run the block's ``statements`` (top-level ``await`` allowed) in ``namespace``."""
    tree = ast.parse(b.text)
    tree.body = tree.body[statements]
    result = eval(_compile(b, tree), namespace)
    if inspect.iscoroutine(result):
        await result
    return namespace


def values(b: Block, namespace: dict[str, Any]) -> list[Any]:
    """The value of each expression statement of the block."""
    out = []
    for stmt in ast.parse(b.text).body:
        assert isinstance(stmt, ast.Expr), f"README.md:{b.line + stmt.lineno - 1}: not an expression"
        expr = ast.Expression(stmt.value)
        ast.increment_lineno(expr, b.line - 1)
        out.append(eval(compile(expr, str(README), "eval"), namespace))
    return out


# ================================================================== what the blocks need
@pytest.fixture
def workers_standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A ``workers`` module for the test: ``DurableObject`` keeps ``ctx`` and ``env``."""
    module = types.ModuleType("workers")

    class DurableObject:
        def __init__(self, ctx: Any, env: Any) -> None:
            self.ctx = ctx
            self.env = env

    module.DurableObject = DurableObject
    monkeypatch.setitem(sys.modules, "workers", module)
    return module


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimClock:
    """Virtual time as the default clock of ``DurabilityScheduler`` and ``SemaphoreClient``
    (the holder and the queue default to the scheduler's)."""
    sim = SimClock(T0)
    monkeypatch.setattr(scheduler_module, "system_clock", sim)
    monkeypatch.setattr(client_module, "system_clock", sim)
    return sim


class Env:
    """An object's ``env``: attributes as given."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


async def until(clock: VirtualClock, condition: Any, within_ms: int = 60_000, step_ms: int = 250) -> None:
    end = clock.now + within_ms
    while not condition():
        assert clock.now < end, "condition not reached in virtual time"
        await clock.advance(step_ms)


def holder_class(b: Block) -> type:
    return run_sync_defs(b)["AccountLimit"]


def run_sync_defs(b: Block) -> dict[str, Any]:
    """Run a block of definitions (no top-level await) and return its namespace."""
    namespace: dict[str, Any] = {"__name__": f"readme_{b.line}"}
    exec(_compile(b, ast.parse(b.text)), namespace)
    return namespace


# ================================================================== coverage of the blocks
def test_every_python_block_is_run_or_marked():
    found = python_blocks()
    assert found, "README.md has no python blocks"
    assert not problems(found, RUN_BY), "\n".join(problems(found, RUN_BY))
    for name in RUN_BY.values():
        assert callable(globals().get(name)), f"RUN_BY names {name}, which this module does not define"


def test_an_unmarked_block_that_nothing_runs_fails_the_check():
    text = ("# T\n\n```python\nx = 1\n```\n\n## Other\n\n<!-- readme-test: not run: a shape -->\n"
            "```python\n{...}\n```\n\n## Third\n\n<!-- readme-test: not run: -->\n```python\ny\n```\n")
    found = python_blocks(text)
    assert [(b.heading, b.marker) for b in found] == [("# T", None), ("## Other", "a shape"), ("## Third", "")]
    assert problems(found, {"# T": "t"}) == ["README.md:18: 'readme-test: not run' needs a reason"]
    (unrun,) = problems(found[:1], {})
    assert "a python block no test runs" in unrun and "README.md:4" in unrun
    assert problems(found[:1], {"# T": "t", "## Gone": "g"}) == [
        "g runs the python block under '## Gone', but there are 0"]


def test_the_sample_worker_blocks_are_covered_by_test_sample_worker():
    samples = [b for b in python_blocks() if b.sample_file is not None]
    assert [b.sample_file for b in samples] == ["src/entry.py"]
    files = readme_files()
    for b in samples:  # tests/test_sample_worker.py checks these ARE examples/worker's files
        assert files[b.sample_file] == b.text
    checks = (ROOT / "tests" / "test_sample_worker.py").read_text(encoding="utf-8")
    assert "def test_the_readme_blocks_are_the_example_files" in checks


# ================================================================== the blocks, run
@async_test
async def test_the_teaser_runs_in_a_client_object(clock: SimClock) -> None:
    """The three lines at the top: two client objects, three exports each, limit 2."""
    b = block("# durability-semaphore")
    holder = HolderSide(clock, limit=2)
    env = Env(ACCOUNT_LIMIT=Namespace(lambda name: holder))
    limits = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="handle")
    running: set[str] = set()
    most = [0]

    async def export(job: str) -> None:
        running.add(job)
        most[0] = max(most[0], len(running))
        await clock.sleep(3_000)
        running.discard(job)

    class ClientObject:  # the object the three lines live in
        def __init__(self, name: str) -> None:
            self.ctx = LocalContext(name=name)
            self.names = dict(semaphore.__dict__, self=self, ctx=self.ctx, env=env, limits=limits, export=export)

    objects = [ClientObject("exports-1"), ClientObject("exports-2")]
    for obj in objects:
        await run(b, obj.names, slice(0, 1))  # the constructor's line
        assert obj.queue.scheduler.clock is clock and obj.queue.client.clock is clock
        TaskAlarmDriver(clock, obj.ctx.storage, obj.queue.scheduler.alarm)

    async def job(obj: ClientObject, name: str) -> None:
        await run(b, dict(obj.names, account_id="acct-1", job=name), slice(1, None))  # async with ...

    tasks = [asyncio.ensure_future(job(obj, f"{obj.ctx.id.name}-{n}")) for obj in objects for n in range(3)]
    await until(clock, lambda: all(t.done() for t in tasks))
    assert [t.exception() for t in tasks] == [None] * 6
    assert most[0] == 2  # at most the account's limit at once, across both objects
    await clock.advance(15_000)
    assert (await holder.usage())["charged"] == 0


@async_test
async def test_the_holder_class_grants_under_its_limits_and_reclaims(clock: SimClock, workers_standin) -> None:
    AccountLimit = holder_class(block("## The holder: `DurabilitySemaphore`"))
    env = Env(ACCOUNT_CONCURRENCY="3")
    holder = AccountLimit(LocalContext(name="acct-1"), env)
    assert holder.ctx is not None and holder.env is env  # the stand-in DurableObject's
    assert holder.scheduler.clock is clock and holder.semaphore.clock is clock
    AlarmDriver(clock, holder.ctx.storage, holder.alarm)
    message = {"type": "request", "v": 1, "clientId": "jobs-1", "grants": [],
               "demand": [{"group": "bulk-exports", "count": 5, "oldestAt": T0},
                          {"group": "default", "count": 5, "oldestAt": T0 + 1}]}
    reply = asyncio.ensure_future(holder.permits(message))
    await until(clock, reply.done)
    grants = {g["group"]: g["permits"] for g in reply.result()["grants"]}
    assert grants == {"bulk-exports": 2, "default": 1}  # group_limit {"bulk-exports": 2}, limit 3
    assert blocked_of(reply.result()) == {"bulk-exports": ("group_limit", 3), "default": ("limit", 4)}
    assert (await holder.semaphore.usage())["charged"] == 3
    await clock.advance(11_000)  # nothing claimed: the alarm (delegated) reclaims at claimBy
    assert (await holder.semaphore.usage())["charged"] == 0


@async_test
async def test_the_wire_format_is_what_the_holder_answers() -> None:
    b = block("### Wire format (v1)")
    message, shape = values(b, {})
    assert parse_message(message).client_id == "queue-7"
    bed = Bed(limit=5, clock=VirtualClock(1_764_500_000_000), leases={"provisioning": {"mode": "strict"}})
    reply = await bed.one(message)

    def check(value: Any, expected: Any, where: str) -> None:
        if isinstance(expected, dict):
            assert isinstance(value, dict) and set(value) == set(expected), (where, value)
            for key in expected:
                check(value[key], expected[key], f"{where}.{key}")
        elif isinstance(expected, list):
            assert isinstance(value, list) and value, (where, value)
            for item in value:
                check(item, expected[0], f"{where}[]")
        elif isinstance(expected, set):
            assert isinstance(value, dict) and set(value) == expected, (where, sorted(value), sorted(expected))
        elif isinstance(expected, type):
            assert isinstance(value, expected), (where, value)
        else:
            assert value == expected, (where, value)

    check(reply, shape, "reply")
    # the comments list the values of "status" and "reason": exactly the library's enums
    listed = {m["key"]: set(m["values"].split(" | "))
              for m in re.finditer(r'"(?P<key>\w+)": \[.*# (?P<values>\w+(?: \| \w+)+)$', b.text, re.MULTILINE)}
    assert listed == {"grants": {s.value for s in GrantStatus}, "leases": {s.value for s in LeaseStatus},
                      "blocked": {r.value for r in BlockedReason}}
    assert {g["status"] for g in reply["grants"]} <= listed["grants"]
    assert {x["status"] for x in reply["leases"]} <= listed["leases"]
    assert {x["reason"] for x in reply["blocked"]} <= listed["blocked"]
    assert {g["grantId"]: g["status"] for g in reply["grants"] if g["group"] is None} == {"9f...": "not_found"}


def _literal(text: str, at: int) -> tuple[Any, int]:
    """The Python literal (a ``{...}`` or a ``"..."``) starting at ``text[at]``, and its end."""
    if text[at] == '"':
        end = text.index('"', at + 1) + 1
    else:
        depth, end = 0, at
        while True:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
            if depth == 0:
                break
    return ast.literal_eval(text[at:end]), end


def _lease_variants(b: Block, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``leases=`` options the block's comments name: ``or <literal>`` replaces the line's
    option (``/ <literal>`` right after one replaces its ``extra``), ``also <name>`` is the
    option's snake_case spelling. A comment-only line continues the previous option's."""
    variants, option = [], None
    for line in b.text.splitlines():
        key = re.match(r'\s*"(\w+)":', line)
        option = key.group(1) if key else option
        comment = line.partition("#")[2]
        for alt in re.finditer(r"\bor (?=[{\"])", comment):
            value, end = _literal(comment, alt.end())
            variants.append(dict(base, **{option: value}))
            if comment[end:].startswith(" / "):
                extra, _ = _literal(comment, end + 3)
                variants.append(dict(base, **{option: dict(value, extra=extra)}))
        for snake in re.findall(r"\balso (\w+)", comment):
            variants.append({(snake if k == option else k): v for k, v in base.items()})
    return variants


@async_test
async def test_the_lease_options_construct() -> None:
    b = block("## Leases")
    s = DurabilityScheduler(LocalContext())
    (sem,) = values(b, {"DurabilitySemaphore": DurabilitySemaphore, "s": s})
    assert isinstance(sem, DurabilitySemaphore) and isinstance(sem.leases, LeaseConfig)
    assert (sem.limit, sem.leases.mode, sem.leases.permits_per_lease, sem.leases.ttl_ms, sem.leases.limited_groups) \
        == (100, Provisioning.STRICT, 64, 1_800_000, LimitedGroups.EXCLUDE)
    base = ast.literal_eval(_strip_comments(b.text))
    variants = _lease_variants(b, base)
    modes = set()
    for leases in variants:  # every spelling the comments offer constructs
        config = DurabilitySemaphore(scheduler=s, limit=100, leases=leases).leases
        assert config is not None
        modes.add(config.mode)
    assert modes == set(Provisioning) and len(variants) >= 7, variants
    assert {v.get("limitedGroups") for v in variants} >= {"withinGroupLimit"}
    assert {"permits_per_lease", "ttl_ms", "limited_groups"} <= {k for v in variants for k in v}


def _strip_comments(text: str) -> str:
    """The ``leases={...}`` literal of the block, without its comments."""
    code = "\n".join(line.partition("#")[0] for line in text.splitlines())
    return re.search(r"leases=(\{.*\})\)", code, re.DOTALL).group(1)


@async_test
async def test_the_client_object_admits_jobs_under_the_limit(clock: SimClock, workers_standin) -> None:
    AccountLimit = holder_class(block("## The holder: `DurabilitySemaphore`"))
    names = run_sync_defs(block("## The client side"))
    JobQueue = names["JobQueue"]

    def make_holder(name: str) -> Any:
        holder = AccountLimit(LocalContext(name=name), env)
        AlarmDriver(clock, holder.ctx.storage, holder.alarm)
        return holder

    env = Env(ACCOUNT_CONCURRENCY="3", ACCOUNT_LIMIT=Namespace(make_holder))
    jobs = JobQueue(LocalContext(name="jobs-1"), env)
    assert jobs.scheduler.clock is clock and jobs.client.clock is clock
    TaskAlarmDriver(clock, jobs.ctx.storage, jobs.alarm)
    for job_id, group in [("b1", "bulk-exports"), ("b2", "bulk-exports"), ("b3", "bulk-exports"),
                          ("d1", "default"), ("d2", "default")]:
        assert await jobs.submit("acct-1", job_id, group, {"job": job_id}) == "queued"
        await clock.advance(10)  # oldest first: the bulk exports are older
    state = lambda: {i.item_id: i.state for i in jobs.queue.items()}  # noqa: E731
    await until(clock, lambda: list(state().values()).count(ItemState.RUNNING) == 3)
    assert [i for i, s in state().items() if s is ItemState.RUNNING] == ["b1", "b2", "d1"]
    assert await jobs.submit("acct-1", "b1", "bulk-exports", {"job": "b1"}) == "running"  # idempotent
    assert jobs.queue.item("b3").blocked.reason is BlockedReason.GROUP_LIMIT  # bulk-exports: 2
    assert jobs.queue.item("d2").blocked.reason is BlockedReason.LIMIT  # ACCOUNT_CONCURRENCY 3
    assert all(i.admitted for i in jobs.queue.items(state=ItemState.RUNNING))  # start_job returned
    await jobs.finished("b1")
    await jobs.finished("d1")
    await until(clock, lambda: state()["b3"] is ItemState.RUNNING and state()["d2"] is ItemState.RUNNING)
    for job_id in ("b2", "b3", "d2"):
        await jobs.finished(job_id)
    assert set(state().values()) == {ItemState.DONE}
    await clock.advance(15_000)
    assert (await env.ACCOUNT_LIMIT.getByName("acct-1").semaphore.usage())["charged"] == 0


@async_test
async def test_the_permit_fragment_holds_and_releases_a_permit() -> None:
    b = block("### Permits: `async with queue.permit(...)`")
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1)
    side = ClientSide("c1", clock, Net(holder, clock))
    task = asyncio.ensure_future(run(b, {"self": side, "key": "acct"}))
    await until(clock, task.done)
    item = task.result()["item"]  # bound by the block's `as item`
    assert item.is_permit and item.permit is not None and item.permit.kind is PermitKind.GRANT
    done = side.queue.item(item.item_id)  # leaving the block released it (the next pump deletes it)
    assert done is None or done.state is ItemState.DONE
    await clock.advance(15_000)
    assert (await holder.usage())["charged"] == 0
