"""The command line: ``autoplan`` (`autoplan.cli.main.main`) and ``python -m autoplan.cli``,
one module per subcommand (`plan`, `show`, `estimate`, `run`, `profile`)."""
