"""Registry built-ins named lazily are imported on first lookup, and only then."""

import sys

import pytest

from scaletrain.utils.registry import Registry


def test_lazy_builtin_imported_on_first_get(tmp_path, monkeypatch):
    (tmp_path / "lazy_plugin_for_test.py").write_text(
        "from tests.utils.test_registry_lazy import REG\n@REG.register('plug')\nclass Plug: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "lazy_plugin_for_test" not in sys.modules
    assert "plug" in REG and REG.names() == ["plug"]
    assert "lazy_plugin_for_test" not in sys.modules  # listing does not import
    assert REG.get("plug").__name__ == "Plug"
    assert "lazy_plugin_for_test" in sys.modules
    with pytest.raises(ValueError, match="unknown thing 'other'; registered: plug"):
        REG.get("other")


REG = Registry("thing", lazy={"plug": "lazy_plugin_for_test"})
