"""glm-cache-server's command line: its defaults are ServerConfig's, and the flags table
the docs carry lists every option."""

import argparse
import re
from dataclasses import fields

from cache_server.cli import build_parser, config_from_args, flags_table
from cache_server.config import ServerConfig


def _options() -> list[str]:
    return [max(a.option_strings, key=len) for a in build_parser()._actions
            if not isinstance(a, argparse._HelpAction)]


def test_every_flag_default_is_the_server_config_field_default():
    parsed = config_from_args(build_parser().parse_args([]))
    for f in fields(ServerConfig):
        assert getattr(parsed, f.name) == f.default, f.name


def test_flags_table_has_one_row_per_option_with_defaults_expanded():
    table = flags_table()
    rows = table.splitlines()
    assert rows[:2] == ["| flag | default | meaning |", "| --- | --- | --- |"]
    options = _options()
    assert len(options) > 20 and len(rows) == 2 + len(options)
    for option in options:
        assert sum(bool(re.match(rf"\| `{re.escape(option)}[ `]", row)) for row in rows) == 1, option
    assert "--help" not in table and "%(" not in table
    chunk_row = next(row for row in rows if row.startswith("| `--chunk-size N` |"))
    default = ServerConfig.min_chunk_size
    assert f"| `{default}` |" in chunk_row and f"(default {default})" in chunk_row
    assert flags_table() == table  # deterministic: the docs compare against it
