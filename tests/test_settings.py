"""Settings: declared once, validated at start, documented in docs/settings.md's table."""

from pathlib import Path

import pytest

from settings import SETTINGS, Settings, SettingsError

SETTINGS_DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_documented_table_matches_declared_settings() -> None:
    rows = [line for line in SETTINGS_DOC.read_text().splitlines() if line.startswith("| `PICOMQ_")]
    expected = [f"| `PICOMQ_{s.name.upper()}` | `{s.default}` | {s.doc} |" for s in SETTINGS]
    assert rows == expected


def test_defaults_parse() -> None:
    settings = Settings.from_environment({})
    assert settings.storage_url == "./data"
    assert settings.long_poll_timeout == 20.0
    assert settings.workers == 1


def test_sweep_interval_is_auto_off_or_seconds() -> None:
    assert Settings.from_environment({}).sweep_interval is None
    assert Settings.from_environment({"PICOMQ_SWEEP_INTERVAL": "0"}).sweep_interval == 0
    assert Settings.from_environment({"PICOMQ_SWEEP_INTERVAL": "90"}).sweep_interval == 90


def test_fractional_long_poll_timeout_is_accepted() -> None:
    assert Settings.from_environment({"PICOMQ_LONG_POLL_TIMEOUT": "0.5"}).long_poll_timeout == 0.5


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("PICOMQ_LONG_POLL_TIMEOUT", "abc"),
        ("PICOMQ_LONG_POLL_TIMEOUT", "-1"),
        ("PICOMQ_LONG_POLL_TIMEOUT", "inf"),
        ("PICOMQ_LONG_POLL_TIMEOUT", "nan"),
        ("PICOMQ_MAX_REQUEST_BYTES", "0"),
        ("PICOMQ_WORKERS", "two"),
        ("PICOMQ_STORAGE_URL", "  "),
        ("PICOMQ_SWEEP_INTERVAL", "-1"),
        ("PICOMQ_SWEEP_INTERVAL", "nan"),
        ("PICOMQ_SWEEP_INTERVAL", "never"),
        ("PICOMQ_WEBHOOK_ALLOWED_NETWORKS", "localhost"),
        ("PICOMQ_WEBHOOK_ALLOWED_NETWORKS", "10.0.0.0/33"),
    ],
)
def test_bad_values_name_the_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        Settings.from_environment({variable: value})
