"""The `engine` command line (frontend.cli.main) and its clients of a running server."""
