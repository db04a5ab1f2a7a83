"""LMCache 0.5.7's operator surface, read from its installed source, and what each part is here.

An operator switching from LMCache's multiprocess server brings four kinds of names: the
server's command-line flags, ``LMCacheMPConnector``'s ``lmcache.mp.*`` connector keys, the
``LMCACHE_*`` environment variables, and the HTTP routes. :func:`scan` lists every one of
them from LMCache's source (parsed with :mod:`ast`, never imported: importing LMCache's
server needs CUDA extensions), and :func:`table` says for each name whether it is

- ``accepted``: the same name with the same meaning here,
- ``refused``: given here, it is answered with a message naming our equivalent: a server flag
  stops the start (:func:`cache_server.lmcache_surface.refusal`, used by :mod:`cache_server.cli`), a connector key stops the
  engine's (:mod:`connector.lmcache_settings`, whose tables the connector rows are derived
  from), a set variable gets one start-up line (:func:`cache_server.lmcache_surface.env_hint`), a route answers 501, or
- ``not applicable``: nothing here could take it, with why: a flag stops the start with that
  reason, a set variable gets its start-up line, a route answers 404.

``tests/server/test_lmcache_surface.py`` checks that the scanned names are exactly the table's, so
a name LMCache adds fails the test by name. ``python -m validation.lmcache_surface``
writes ``docs/lmcache-surface.md``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

from cache_server.lmcache_surface import _NO_SCRIPT, ACCEPTED, REFUSED, SERVER_FLAGS, STATUSES, _a, _n, _r, env_vars

KINDS = ("server flags", "connector keys", "environment variables", "HTTP routes")

# Where LMCache builds its MP server's command lines: module, function (Class.method).
SERVER_ENTRIES = (
    ("lmcache.v1.multiprocess.server", "parse_args", "python -m lmcache.v1.multiprocess.server"),
    ("lmcache.v1.multiprocess.http_server", "parse_args", "python -m lmcache.v1.multiprocess.http_server"),
    ("lmcache.cli.commands.server", "ServerCommand.add_arguments", "lmcache server"),
)
# Where LMCacheMPConnector reads its settings (and what those modules import, in this package).
CONNECTOR_ENTRIES = ("lmcache.integration.vllm.lmcache_mp_connector",
                     "lmcache.integration.vllm.vllm_multi_process_adapter")
CONNECTOR_PACKAGE = "lmcache.integration.vllm"
# The MP server's HTTP API: every ``*_api`` module of these packages is registered
# (HTTPAPIRegistry and http_apis/common_api.py discover them by file name).
HTTP_API_PACKAGES = ("lmcache.v1.multiprocess.http_apis", "lmcache.v1.multiprocess.http_apis.common")
# The L2 adapters ``--l2-adapter`` loads: every ``*_l2_adapter`` module (found by pkgutil there).
L2_ADAPTER_PACKAGE = "lmcache.v1.distributed.l2_adapters"

_ENV_NAME = re.compile(r"LMCACHE_[A-Z0-9_]+")
_MP_KEY = re.compile(r"lmcache\.mp\.[a-z0-9_]*[a-z0-9](\.[a-z0-9_]*[a-z0-9])*")  # not a prefix ("..._")
_HTTP_METHODS = ("get", "post", "put", "delete", "patch")


# ---------------------------------------------------------------- reading LMCache's source

@cache
def lmcache_root() -> Path:
    """The installed ``lmcache`` package's directory (found, not imported)."""
    spec = importlib.util.find_spec("lmcache")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("lmcache is not installed (pip install lmcache-cli==0.5.7)")
    return Path(list(spec.submodule_search_locations)[0])


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "lmcache":
        return None
    base = lmcache_root().joinpath(*parts[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def _tree(module: str) -> ast.Module | None:
    path = _module_file(module)
    return ast.parse(path.read_text(), str(path)) if path is not None else None


def _is_package(module: str) -> bool:
    path = _module_file(module)
    return path is not None and path.name == "__init__.py"


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if _is_package(module) else 0)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def _imported_names(module: str) -> dict[str, tuple[str, str]]:
    """``local name -> (module, name)`` for every ``from X import Y`` anywhere in ``module``
    (function-local imports included: LMCache imports its server's parts inside functions)."""
    out: dict[str, tuple[str, str]] = {}
    tree = _tree(module)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                out[alias.asname or alias.name] = (source, alias.name)
    return out


def _imported_modules(module: str) -> set[str]:
    """The ``lmcache`` modules ``module`` imports (at any depth of its code)."""
    out: set[str] = set()
    tree = _tree(module)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("lmcache."))
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            if source.startswith("lmcache"):
                out.add(source)
                out.update(f"{source}.{a.name}" for a in node.names if _module_file(f"{source}.{a.name}"))
    return {m for m in out if _module_file(m) is not None}


def _closure(entries: Iterable[str], within: str = "lmcache") -> list[str]:
    """``entries`` and every module of package ``within`` they import, transitively."""
    seen: set[str] = set()
    todo = [m for m in entries if _module_file(m) is not None]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(m for m in _imported_modules(module) if m == within or m.startswith(within + "."))
    return sorted(seen)


def _definition(module: str, qualname: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """The function (or ``Class.method``) ``qualname`` as seen from ``module``, following imports."""
    tree = _tree(module)
    if tree is None or depth > 8:
        return None
    head, _, rest = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == head:
            if not rest:
                return module, node
            for inner in getattr(node, "body", []):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) and inner.name == rest:
                    return module, inner
            return None
    if head in _imported_names(module):
        source, name = _imported_names(module)[head]
        return _definition(source, name + ("." + rest if rest else ""), depth + 1)
    return None


@cache
def _module_constants(module: str) -> dict[str, str]:
    """Module-level ``NAME = "text"`` (and ``NAME: T = "text"``) assignments of ``module``."""
    out: dict[str, str] = {}
    tree = _tree(module)
    for node in tree.body if tree is not None else ():
        targets, value = ((node.targets, node.value) if isinstance(node, ast.Assign) else
                          ([node.target], node.value) if isinstance(node, ast.AnnAssign) else ([], None))
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            out.update((t.id, value.value) for t in targets if isinstance(t, ast.Name))
    return out


def _text(module: str, node: ast.AST | None, depth: int = 0) -> str | None:
    """A string the expression ``node`` of ``module`` always is: a literal, or a constant of
    this module or one it imports."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name) and depth < 8:
        if node.id in _module_constants(module):
            return _module_constants(module)[node.id]
        if node.id in _imported_names(module):
            source, name = _imported_names(module)[node.id]
            return _text(source, ast.Name(id=name), depth + 1) if _tree(source) is not None else None
    return None


# ---------------------------------------------------------------- the four scans

def _flags_of(module: str, function: ast.AST, seen: set[tuple[str, int]]) -> Iterator[str]:
    if (module, id(function)) in seen:
        return
    seen.add((module, id(function)))
    for node in ast.walk(function):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("-")]
            yield from names
            action = next((k.value for k in node.keywords if k.arg == "action"), None)
            if isinstance(action, ast.Attribute) and action.attr == "BooleanOptionalAction":
                yield from ("--no-" + n[2:] for n in names if n.startswith("--"))
        elif isinstance(node.func, ast.Name):
            found = _definition(module, node.func.id)
            if found is not None:
                yield from _flags_of(*found, seen)


def scan_server_flags() -> dict[str, tuple[str, ...]]:
    """Every option string of LMCache's MP server command lines -> the commands that take it."""
    out: dict[str, list[str]] = {}
    for module, function, command in SERVER_ENTRIES:
        found = _definition(module, function)
        if found is None:
            raise LookupError(f"LMCache's {command} parser is not at {module}.{function} any more")
        for flag in _flags_of(*found, set()):
            if command not in out.setdefault(flag, []):
                out[flag].append(command)
    return {flag: tuple(commands) for flag, commands in sorted(out.items())}


def _fstring_keys(module: str, tree: ast.AST) -> Iterator[str]:
    """``f"lmcache.mp.prefix_{name}"`` inside a function ``f(name, ...)``: the keys its calls
    with a literal first argument make (LMCache's lazy-offload tunables)."""
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in outer.body:
            if not isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)) or not inner.args.args:
                continue
            param = inner.args.args[0].arg
            for node in ast.walk(inner):
                if (isinstance(node, ast.JoinedStr) and len(node.values) == 2
                        and isinstance(node.values[0], ast.Constant)
                        and str(node.values[0].value).startswith("lmcache.mp.")
                        and isinstance(node.values[1], ast.FormattedValue)
                        and isinstance(node.values[1].value, ast.Name) and node.values[1].value.id == param):
                    for call in ast.walk(outer):
                        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                                and call.func.id == inner.name and call.args):
                            arg = _text(module, call.args[0])
                            if arg is not None:
                                yield node.values[0].value + arg


def _enum_keys(module: str, tree: ast.AST) -> Iterator[str]:
    """Members of an enum class whose names a ``"lmcache.mp."`` prefix constant is joined to
    (``_EXTRA_CONFIG_KEY_PREFIX + ExtraConfigDefault.<member>.name``, and the loop over the
    members in ``_resolve_extra_config``): every member is a key."""
    prefixes = {n for n, v in _module_constants(module).items() if v == "lmcache.mp."}
    if not prefixes:
        return
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef) or not any(
                isinstance(b, ast.Attribute) and b.attr == "Enum" for b in node.bases):
            continue
        used = any(isinstance(n, ast.Name) and n.id == node.name for n in ast.walk(tree))
        if not used:
            continue
        for item in node.body:
            if isinstance(item, ast.Assign):
                for target in item.targets:
                    if isinstance(target, ast.Name) and not target.id.startswith("_"):
                        yield "lmcache.mp." + target.id


def scan_connector_keys() -> list[str]:
    """Every ``lmcache.mp.*`` key of ``kv_connector_extra_config`` LMCacheMPConnector and the
    modules of its package it imports read: literal keys, constants, the adapter's
    ``ExtraConfigDefault`` members and f-string tunables."""
    keys: set[str] = set()
    for module in _closure(CONNECTOR_ENTRIES, CONNECTOR_PACKAGE):
        tree = _tree(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _MP_KEY.fullmatch(node.value):
                keys.add(node.value)
        keys.update(_fstring_keys(module, tree))
        keys.update(_enum_keys(module, tree))
    return sorted(keys)


def _is_os_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _env_reads(module: str) -> Iterator[str]:
    """Names ``module`` reads with ``os.environ.get/[]/in/setdefault/pop`` or ``os.getenv``,
    and its ``*ENV*`` constants holding an ``LMCACHE_*`` name (passed on to such a read, as
    LMCache's API-key loader takes its variables' names)."""
    tree = _tree(module)
    for node in ast.walk(tree):
        arg = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (
                    (f.attr in ("get", "setdefault", "pop") and _is_os_environ(f.value))
                    or (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os")):
                arg = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_os_environ(node.value):
            arg = node.slice
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_os_environ(node.comparators[0])):
            arg = node.left
        name = _text(module, arg) if arg is not None else None
        if name is not None:
            yield name
    for constant, value in _module_constants(module).items():
        if "ENV" in constant.upper() and _ENV_NAME.fullmatch(value):
            yield value + ("*" if value.endswith("_") else "")  # a prefix: a family of variables
    for node in ast.walk(tree):  # f"LMCACHE_{...}": a family named by a pattern
        if (isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant)
                and str(node.values[0].value).startswith("LMCACHE_")):
            yield ast.unparse(node)[2:-1]  # f'LMCACHE_{attr_name.upper()}' -> LMCACHE_{attr_name.upper()}


def scanned_modules() -> list[str]:
    """The modules whose variables count: the MP server's and the connector's, with what
    they import from LMCache, and the HTTP API modules (registered by file name)."""
    entries = [m for m, _, _ in SERVER_ENTRIES] + list(CONNECTOR_ENTRIES) + _http_api_modules()
    adapters = _module_file(L2_ADAPTER_PACKAGE)
    if adapters is None:
        raise LookupError(f"LMCache's L2 adapter package {L2_ADAPTER_PACKAGE} is not there any more")
    entries += [f"{L2_ADAPTER_PACKAGE}.{p.stem}" for p in sorted(adapters.parent.glob("*_l2_adapter.py"))]
    return _closure(entries)


def scan_env_vars() -> dict[str, tuple[str, ...]]:
    """Every ``LMCACHE_*`` variable those modules read -> the modules that read it."""
    out: dict[str, set[str]] = {}
    for module in scanned_modules():
        for name in _env_reads(module):
            if name.startswith("LMCACHE_") and (_ENV_NAME.fullmatch(name.rstrip("*")) or "{" in name):
                out.setdefault(name, set()).add(module)
    return {name: tuple(sorted(modules)) for name, modules in sorted(out.items())}


def _http_api_modules() -> list[str]:
    out = []
    for package in HTTP_API_PACKAGES:
        directory = _module_file(package)
        if directory is None:
            raise LookupError(f"LMCache's HTTP API package {package} is not there any more")
        out += [f"{package}.{p.stem}" for p in sorted(directory.parent.glob("*_api.py"))]
    return out


def scan_http_routes() -> dict[str, str]:
    """``"METHOD /path"`` of every ``@router.<method>(path)`` of LMCache's MP HTTP API -> its module."""
    out: dict[str, str] = {}
    for module in _http_api_modules():
        for node in ast.walk(_tree(module)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and dec.func.attr in _HTTP_METHODS and dec.args):
                    path = _text(module, dec.args[0])
                    if path is not None:
                        out[f"{dec.func.attr.upper()} {path}"] = module
    return dict(sorted(out.items(), key=lambda kv: (kv[0].split(" ", 1)[1], kv[0])))


def scan() -> dict[str, list[str]]:
    """The names of each kind, as LMCache's installed source has them."""
    return {"server flags": list(scan_server_flags()), "connector keys": scan_connector_keys(),
            "environment variables": list(scan_env_vars()), "HTTP routes": list(scan_http_routes())}



# ---------------------------------------------------------------- what each name is here

# Connector keys: derived from connector.lmcache_settings (its key table and translate()), by
# asking it: a key is accepted where some value passes translate(), refused where none does.
_EXAMPLES: dict[str, object] = {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": 5555,
                                "lmcache.mp.server_urls": "tcp://127.0.0.1:5555",
                                "lmcache.mp.save_decode_cache": True}
_PROBES: tuple[object, ...] = (True, False, "blake3", "engine_driven")


def _connector_entry(key: str) -> tuple[str, str]:
    from connector.lmcache_settings import translate  # pure Python: no vLLM

    if key in _EXAMPLES:
        example = {key: _EXAMPLES[key]}
        ours = translate(example)
        return ACCEPTED, "sets " + ", ".join(f"{k}={v!r}" for k, v in ours.items()) + f" (from {_EXAMPLES[key]!r})"
    passed, why = [], ""
    for value in _PROBES:
        try:
            translate({key: value})
            passed.append(value)
        except ValueError as e:
            why = why or _why(str(e), key)
    if not passed:
        return REFUSED, why + " (refused at the engine's start, by name)"
    return ACCEPTED, f"only {passed[0]!r} (what GlmCacheConnector does); other values refused: {why}"


def _why(message: str, key: str) -> str:
    """The reason in connector.lmcache_settings' refusal ("... KEY[=VALUE]: WHY; remove it ...")."""
    after = message.split(key, 1)[-1]
    after = after.split(": ", 1)[-1]
    return after.split("; remove it", 1)[0]


def connector_keys() -> dict[str, tuple[str, str]]:
    """Every ``lmcache.mp.*`` key connector.lmcache_settings knows -> (status, what it does here)."""
    from connector.lmcache_settings import _KEYS

    return {key: _connector_entry(key) for key in sorted(_KEYS)}


_NO_SUCH = "no such machinery here: answered 404"
# LMCache MP HTTP route -> (status, what it is here). "refused": answered with a status and a
# message that names our equivalent (501 for /quota); "not applicable": 404 (see why).
HTTP_ROUTES: dict[str, tuple[str, str]] = {
    "GET /": _a("a static liveness payload, open without a key as in LMCache"),
    "GET /healthcheck": _a('liveness, open without a key (the body is {"status": "healthy"}, as LMCache\'s)'),
    "GET /status": _a("LMCache's fields (is_healthy, engine_type, chunk_size, storage_manager.*, "
                      "cache_context_meta) beside ours"),
    "GET /version": _a("our version and commit"),
    "GET /lmc_version": _a("our version"),
    "GET /commit_id": _a("our commit"),
    "GET /config": _a("the effective configuration (also /conf), secrets left out"),
    "GET /metrics": _a("Prometheus text: lmcache_mp_* under LMCache's names beside our glm_cache_*"),
    "POST /cache/clear": _a("clears L1 (only unleased objects unless force), LMCache's body and answer"),
    "GET /quota": _r("501: no per-salt quotas, every namespace shares --l1-size-gb (and --l1-state-share)"),
    "GET /quota/{cache_salt}": _r("501: no per-salt quotas, every namespace shares --l1-size-gb"),
    "PUT /quota/{cache_salt}": _r("501: no per-salt quotas, every namespace shares --l1-size-gb"),
    "DELETE /quota/{cache_salt}": _r("501: no per-salt quotas, every namespace shares --l1-size-gb"),
    "GET /cache/objects": _n("no object listing: /status counts objects per namespace; " + _NO_SUCH),
    "DELETE /cache/objects": _n("no per-object delete by LMCache key: POST /cache/clear?ns=NAMESPACE; " + _NO_SUCH),
    "POST /cache/prefetches": _n("no prefetch jobs: a lookup promotes from L2 itself; " + _NO_SUCH),
    "GET /cache/prefetches/{request_id}": _n("no prefetch jobs; " + _NO_SUCH),
    "POST /cache/checksums": _n("every object carries a checksum the connector checks before vLLM's cache; "
                                + _NO_SUCH),
    "GET /config/adapters": _n("one L2 tier: /status's l2 and storage_manager.l2_adapters describe it; " + _NO_SUCH),
    "GET /env": _n("the server's environment is not served; " + _NO_SUCH),
    "GET /loglevel": _n("the log level is --log-level, fixed at start; " + _NO_SUCH),
    "POST /metrics/reset": _n("counters are never reset (Prometheus counters are monotonic); " + _NO_SUCH),
    "GET /threads": _n(_NO_SUCH),
    "GET /periodic-threads": _n("no periodic threads; " + _NO_SUCH),
    "GET /periodic-threads/{thread_name}": _n("no periodic threads; " + _NO_SUCH),
    "GET /periodic-threads-health": _n("no periodic threads; " + _NO_SUCH),
    "POST /reconfigure/dax/l1/add": _n("no DEVDAX L1, no live reconfiguration; " + _NO_SUCH),
    "POST /reconfigure/dax/l1/remove": _n("no DEVDAX L1, no live reconfiguration; " + _NO_SUCH),
    "GET /reconfigure/dax/l1/status": _n("no DEVDAX L1, no live reconfiguration; " + _NO_SUCH),
    "GET /reconfigure/{backend}/l2/status": _n("no live reconfiguration: restart with another --l2; " + _NO_SUCH),
    "POST /reconfigure/{backend}/l2/{operation}": _n("no live reconfiguration: restart with another --l2; "
                                                      + _NO_SUCH),
    "POST /run_script": _n(_NO_SCRIPT + "; " + _NO_SUCH),
}


def table() -> dict[str, dict[str, tuple[str, str]]]:
    """Every kind: LMCache name -> (status, our equivalent or why)."""
    return {"server flags": dict(SERVER_FLAGS), "connector keys": connector_keys(),
            "environment variables": env_vars(), "HTTP routes": dict(HTTP_ROUTES)}


def _cell(text: str) -> str:
    return text.replace("|", r"\|").replace("\n", " ")


def markdown() -> str:
    """docs/lmcache-surface.md: the table, with where LMCache reads each name."""
    where = {"server flags": {k: ", ".join(f"`{c}`" for c in v) for k, v in scan_server_flags().items()},
             "connector keys": {},
             "environment variables": {k: ", ".join(f"`{m}`" for m in v) for k, v in scan_env_vars().items()},
             "HTTP routes": {k: f"`{m.rsplit('.', 1)[1]}`" for k, m in scan_http_routes().items()}}
    rows = table()
    out = ["# LMCache 0.5.7's surface, name by name", "",
           "Generated by `python -m validation.lmcache_surface > docs/lmcache-surface.md` from LMCache's "
           "installed source (`lmcache-cli`, read with `ast`); `tests/server/test_lmcache_surface.py` checks that "
           "the names below are exactly the ones that source has, so a name LMCache adds fails the test, "
           "and that each row behaves as it says. See [migrating-from-lmcache.md](migrating-from-lmcache.md) "
           "for the switch itself.", "",
           "- **accepted**: the same name with the same meaning here.",
           "- **refused**: a server flag stops `glm-cache-server` (exit 2) with a message naming our "
           "equivalent; a connector key stops the engine's start (GlmCacheConnector, ValueError) with why; "
           "a set variable is named at start-up, one line, with our equivalent; a route answers 501 with why.",
           "- **not applicable**: nothing here could take it: a flag stops the start (exit 2) with this "
           "reason, a set variable gets its one start-up line, a route answers 404.", "",
           "| kind | accepted | refused | not applicable |", "| --- | --- | --- | --- |"]
    for kind in KINDS:
        counts = [sum(1 for s, _ in rows[kind].values() if s == status) for status in STATUSES]
        out.append(f"| {kind} | " + " | ".join(map(str, counts)) + " |")
    headings = {"server flags": ("flag", "LMCache's commands taking it"),
                "connector keys": ("`kv_connector_extra_config` key", None),
                "environment variables": ("variable", "LMCache modules reading it"),
                "HTTP routes": ("route", "LMCache module")}
    for kind in KINDS:
        name, source = headings[kind]
        out += ["", f"## {kind[0].upper()}{kind[1:]}", ""]
        if source:
            out += [f"| {name} | status | here | {source} |", "| --- | --- | --- | --- |"]
        else:
            out += [f"| {name} | status | here |", "| --- | --- | --- |"]
        for key, (status, text) in rows[kind].items():
            row = f"| `{key}` | {status} | {_cell(text)} |"
            out.append(row + (f" {where[kind].get(key, '')} |" if source else ""))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
