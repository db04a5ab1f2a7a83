"""What every folder of the suite shares (tests/unit, tests/server, tests/engine: docs/testing.md,
"Folders by cost"): the fixtures below, the ``vllm_free`` marking, the two xdist lanes, the
machine-stall watch and the per-worker time summary. Helpers live in ``testing/``; each
folder's conftest.py holds what only that folder uses."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from testing.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(request):
    """glm-cache-server with separate object groups on free loopback ports, for one test
    module: with the module's ``SERVER_ARGS`` (its other flags), else minimum chunk 256, 1 GB
    of L1 and the debug fault hook (so tests can flip a stored byte)."""
    args = getattr(request.module, "SERVER_ARGS", ("--chunk-size", "256", "--l1-size-gb", "1", "--debug-fault-hooks"))
    with ServerProcess("--separate-object-groups", *args) as srv:
        yield srv


SERVER_CHUNK = 256  # the server fixture's minimum chunk


@pytest.fixture(scope="module")
def ckpt(request, tmp_path_factory):
    """The tiny GLM-5.3-Flash checkpoint (``glm5next_tiny``) for one test
    module: seed 3, as the engines' tests write it, unless the module sets
    ``TINY_CHECKPOINT_ARGS`` (the generator's arguments after the output path, e.g.
    ``("--seed", "1")``)."""
    import glm5next_tiny

    out = tmp_path_factory.mktemp("tiny_" + request.module.__name__.rpartition("test_")[2])
    glm5next_tiny.main([str(out), *getattr(request.module, "TINY_CHECKPOINT_ARGS", ("--seed", "3"))])
    return out


@pytest.fixture(scope="module")
def cluster():
    """A three-node Redis cluster for one module (``testing.l2_fixtures.start_cluster``);
    skips, saying why, where no Redis or Valkey server can run."""
    from testing.l2_fixtures import start_cluster

    nodes = start_cluster()
    yield nodes
    nodes.stop()


@pytest.fixture()
def sides(server):
    """``sides(**kw)`` makes a real scheduler side (``testing.sched_harness``) on the module's
    server, with a block of the server's minimum chunk unless ``block`` is given; all are
    shut down after the test."""
    from testing.sched_harness import scheduler_side

    made = []

    def make(**kw):
        s = scheduler_side(server.url, **{"block": SERVER_CHUNK, **kw})
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()


# -- Tests that cannot depend on vLLM's version ---------------------------------------------
#
# `make test-vllm033` reruns the engine-free tests on vLLM 0.33; a test whose module, the
# project modules it imports (at any depth, function-local imports included) and the
# conftest fixtures it uses never import vLLM, the connector, the plugin or an engine helper
# tests glm-cache-server alone and gives the same result on either: it is marked
# `vllm_free` (found here from the sources, so a new import moves a test back) and runs once.

import ast  # noqa: E402
from functools import cache  # noqa: E402
from pathlib import Path  # noqa: E402

_ROOT = Path(__file__).resolve().parent.parent
# glm5next_tiny: the tiny checkpoint it writes comes from transformers, whose version is the one
# the vLLM install brings, so tests that use it depend on vLLM's release
_VLLM_SIDE = ("vllm", "connector", "glm5next_plugin", "glm5next_tiny", "validation.serving", "testing.sched_harness",
              "validation.demo", "testing.engines", "testing.tiny_qwen3_next")
# strings that start vLLM in another process (a command line, a notebook, the demo)
_VLLM_WORDS = ("vllm", ".ipynb", "demo")


def _imports(tree: ast.AST, package: str = "") -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([p for p in parts if p] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _file_of(module: str) -> Path | None:
    # from the repository root: a test module is tests.<folder>.test_x, a helper testing.x
    path = _ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _starts_vllm(tree: ast.AST) -> bool:
    """A string (not a docstring) naming vLLM, a notebook or the demo: run elsewhere."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
               and any(w in n.value.lower() for w in _VLLM_WORDS) for n in ast.walk(tree))


def _direct_vllm(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") or module.endswith("." + m) for m in _VLLM_SIDE)


@cache
def _edges(module: str) -> tuple[bool, frozenset[str]]:
    """(the module itself names vLLM, the modules it imports), from its source."""
    if _direct_vllm(module):
        return True, frozenset()
    path = _file_of(module)
    if path is None:
        return False, frozenset()  # a third-party module other than vLLM, or a name in a module
    tree = ast.parse(path.read_text())
    if path.relative_to(_ROOT).parts[0] != "cache_server" and _starts_vllm(tree):  # the server (its client too) starts no engine
        return True, frozenset()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    return False, frozenset(_imports(tree, package))


@cache
def _touches_vllm(module: str) -> bool:
    """Whether ``module`` or anything it imports, at any depth, names vLLM."""
    seen, todo = {module}, [module]
    while todo:
        direct, imports = _edges(todo.pop())
        if direct:
            return True
        for m in imports - seen:
            seen.add(m)
            todo.append(m)
    return False


@cache
def _conftest_fixture_imports(conftest: Path = Path(__file__)) -> dict[str, set[str]]:
    if not conftest.is_file():
        return {}
    tree = ast.parse(conftest.read_text())
    return {f.name: _imports(f) for f in tree.body if isinstance(f, ast.FunctionDef)}


def _module_of(item) -> str:
    """The test's module as a dotted name from the repository root: tests.unit.test_store."""
    return ".".join(Path(str(item.fspath)).resolve().relative_to(_ROOT).with_suffix("").parts)


def pytest_collection_modifyitems(config, items):
    for item in items:
        # this file's fixtures, and those of the test's folder's conftest.py (which override them)
        fixtures = {**_conftest_fixture_imports(), **_conftest_fixture_imports(Path(str(item.fspath)).parent / "conftest.py")}
        used = [m for name in getattr(item, "fixturenames", ()) for m in fixtures.get(name, ())]
        if not _touches_vllm(_module_of(item)) and not any(_touches_vllm(m) for m in used):
            item.add_marker(pytest.mark.vllm_free)
    _check_folders(items)


# -- Folders by cost (docs/testing.md) ------------------------------------------------------
#
# A module with an engine test (`pytest.mark.engine`: what puts it in the engine lane below)
# lives in tests/engine/, and only such a module: `pytest tests/unit tests/server` must never
# start an engine.
FOLDERS = ("unit", "server", "engine")


def _check_folders(items) -> None:
    misplaced = sorted({path for path in (item.nodeid.split("::", 1)[0] for item in items)
                        if path.startswith("tests/") and (len(path.split("/")) != 3 or path.split("/")[1] not in FOLDERS
                                                          or _engine_module(path) != path.startswith("tests/engine/"))})
    if misplaced:
        raise pytest.UsageError("a test module lives in tests/unit, tests/server or tests/engine, and in tests/engine "
                                "exactly when it has an engine test (docs/testing.md): " + ", ".join(misplaced))


# -- Two lanes (`make test` runs pytest-xdist with two workers) ----------------------------------
#
# vLLM's CPU worker binds its compute threads itself: a connector engine to both cores of
# this host, any other to the first, so two engines at once share cores and twice the
# memory. Every module with
# an engine test that uses the external cache runs in one lane, one module after another as
# without xdist: the connector's 2 s request deadline is part of what those tests check, so
# they never run beside another engine. Each other module is a unit of its own (its fixtures
# start once); the second worker runs those (~700 engine-free tests: servers, clients,
# connector sides) beside the engines, and then the engine modules that never start a cache
# server or a connector (PLUGIN_ENGINE_MODULES: the model plugin alone, deadline-free), which
# on these 2 cores would otherwise leave it idle for most of the run: measured at d25ff21,
# the second worker finished its tests 383 s into a 1560 s run.
PLUGIN_ENGINE_MODULES = frozenset({
    "tests/engine/test_plugin_engine.py", "tests/engine/test_plugin_mtp.py", "tests/engine/test_plugin_parity_sweep.py",
    "tests/engine/test_plugin_serve.py", "tests/engine/test_plugin_tp.py", "tests/engine/test_plugin_vision.py",
    # Not the short soak (tests/engine/test_soak.py, last in the engine lane): its two replicas, three
    # Redis nodes and faults beside the engine lane made that lane's reloads miss while the
    # soak started (fresh-clone run beside a busy loop at fb9e98e: test_plugin_ties and
    # test_pd_e2e served cold; CI at 6071907: test_multiconnector_e2e's load, its get
    # reaching the server after its 30 s deadline), and once held an engine's start-up
    # past 600 s.
})
PLUGIN_LANE = "engines without the external cache"


@cache
def _engine_module(path: str) -> bool:
    return "mark.engine" in (_ROOT / path).read_text()


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class EngineLanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in PLUGIN_ENGINE_MODULES:
                return PLUGIN_LANE
            return "engines" if _engine_module(path) else path

        def _assign_work_unit(self, node) -> None:
            # the plugin's engines go last, after the engine-free modules
            if len(self.workqueue) > 1 and next(iter(self.workqueue)) == PLUGIN_LANE:
                self.workqueue.move_to_end(PLUGIN_LANE)
            super()._assign_work_unit(node)

    return EngineLanes(config, log)


# -- Machine stalls (testing.stalls) ---------------------------------------------------------
#
# The test run's controller (no test runs in it: it only sleeps) notes each time a CPU of the
# machine stood still, and the summary lists them: a deadline that passed during one was
# the machine's, whatever the failure says.
_STALLS_KEY = pytest.StashKey["StallWatch"]()


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller watches
        return
    from testing.stalls import StallWatch

    config.stash[_STALLS_KEY] = StallWatch().start()


# -- Where the run's time went: each worker's modules (the lanes above), in seconds -----------
def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # the xdist worker that ran it (absent without xdist)
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    lanes = _LANE_TIMES.setdefault(worker, {"modules": Counter(), "last": 0.0})
    lanes["modules"][report.nodeid.split("::", 1)[0]] += report.duration
    lanes["last"] = time.monotonic()


_LANE_TIMES: dict[str, dict] = {}
_RUN_START = time.monotonic()


def _write_lanes(terminalreporter) -> None:
    """Each worker: when it finished, its busiest modules, so the critical path is in sight."""
    if not _LANE_TIMES:
        return
    terminalreporter.write_sep("-", "lanes (seconds per worker and module, setup and teardown included)")
    for worker, lane in sorted(_LANE_TIMES.items()):
        modules = lane["modules"]
        top = ", ".join(f"{Path(m).stem.removeprefix('test_')} {s:.0f}" for m, s in modules.most_common(12))
        terminalreporter.write_line(f"{worker}: done at {lane['last'] - _RUN_START:.0f} s, {sum(modules.values()):.0f} s "
                                    f"in {len(modules)} modules; most: {top}")


def pytest_terminal_summary(terminalreporter, config):
    if not hasattr(config, "workerinput"):
        _write_lanes(terminalreporter)
    watch = config.stash.get(_STALLS_KEY, None)
    if watch is None:
        return
    watch.stop()
    if watch.stalls:
        terminalreporter.write_sep("-", "machine stalls")
        terminalreporter.write_line(
            f"a CPU stood still {len(watch.stalls)} time(s) ({watch.describe(watch.stalls)}): a thread running or "
            "pinned there then was late, and a request it had in flight was late on both sides (testing/stalls.py)")
