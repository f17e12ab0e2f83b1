"""``python -m graphbuf`` runs the same CLI as the ``graphbuf`` console script."""

from graphbuf.cli import main

raise SystemExit(main())
