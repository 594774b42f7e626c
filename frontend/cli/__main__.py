"""`python -m frontend.cli ...` is the `engine` command."""

import sys

from frontend.cli.main import main

sys.exit(main())
