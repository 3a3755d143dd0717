"""``python -m rollhub ...``."""

from rollhub.cli import main

raise SystemExit(main())
