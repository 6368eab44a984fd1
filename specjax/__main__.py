"""``python -m specjax``: the ``specjax`` command line."""

from specjax.cli import console

console()
