"""``python -m specjax``: the ``specjax`` command line."""

from specjax.cli import main

raise SystemExit(main())
