"""The operator docs' tables of server flags and connector settings are the code's own:
generated from the argparse parser and the Settings declarations, so a default or a
meaning changed in one place is changed in the docs too (or this fails)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_tables_are_generated_from_the_code():
    mod = _script()
    text = (ROOT / "docs" / "operating.md").read_text()
    assert mod.render(text) == text, "docs/operating.md is out of date: run python scripts/docs_tables.py"


def test_every_connector_setting_is_documented_with_its_default():
    from connector.config import Settings, settings_table

    table = settings_table()
    for f in Settings.__dataclass_fields__.values():
        if "key" in f.metadata:
            row = next(line for line in table.splitlines() if line.startswith(f"| `{f.metadata['key']}` |"))
            shown = "none" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
            assert shown in row
    text = (ROOT / "docs" / "operating.md").read_text()
    assert table in text


def test_settings_defaults_are_what_an_empty_extra_config_parses_to():
    from vllm.config import KVTransferConfig

    from connector.config import Settings

    parsed = Settings.from_config(KVTransferConfig(kv_connector="GlmCacheConnector", kv_role="kv_both"))
    assert parsed == Settings()
    custom = Settings.from_config(KVTransferConfig(
        kv_connector="GlmCacheConnector", kv_role="kv_both",
        kv_connector_extra_config={"server": "tcp://h:1", "batch_bytes": "4096", "save_decode": "false",
                                   "chunk_keys": "LMCache", "transfer_cpus": "3,1"}))
    assert (custom.url, custom.batch_bytes, custom.save_decode, custom.chunk_keys, custom.transfer_cpus) == (
        "tcp://h:1", 4096, False, "lmcache", (1, 3))
