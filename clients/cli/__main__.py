"""`python -m clients.cli`: the `pagedserve` command."""

from clients.cli.main import main

raise SystemExit(main())
