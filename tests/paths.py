"""Where the tests find the checkout, its fixtures and its notebooks (test modules live one
folder down, ``tests/<area>/``)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
