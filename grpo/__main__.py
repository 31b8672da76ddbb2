"""`python -m grpo ...` is the `grpo` command."""

from grpo.cli import main

raise SystemExit(main())
