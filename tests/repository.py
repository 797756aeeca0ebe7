"""The repository's root, for tests that read its files or start processes in it (the test
modules sit one folder below `tests/`, so each would otherwise count its own parents)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
