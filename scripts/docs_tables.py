"""Write the tables of docs/operating.md that are generated from the code: the server's
flags (``cache_server.cli.flags_table``) and the connector's settings
(``connector.config.settings_table``). ``--check`` only says whether they are current
(what ``tests/unit/test_docs_tables.py`` asserts).

    .venv/bin/python scripts/docs_tables.py [--check]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "operating.md"


def tables() -> dict[str, str]:
    """Each generated table by its marker name."""
    from cache_server.cli import flags_table
    from connector.config import settings_table

    return {"server-flags": flags_table(), "connector-settings": settings_table()}


def render(text: str) -> str:
    """``text`` with every generated table replaced by what the code says now."""
    for name, table in tables().items():
        pattern = re.compile(
            rf"(<!-- BEGIN generated: {re.escape(name)} [^\n]*-->\n)(.*?)(<!-- END generated: {re.escape(name)} -->)",
            re.S,
        )
        text, n = pattern.subn(lambda m: m.group(1) + table + m.group(3), text)
        if n != 1:
            raise SystemExit(f"{DOC}: expected one generated block named {name}, found {n}")
    return text


def main() -> int:
    text = DOC.read_text()
    new = render(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print(f"{DOC} is out of date: run python scripts/docs_tables.py")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
