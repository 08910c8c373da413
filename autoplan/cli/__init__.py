"""The command line: ``autoplan`` (`autoplan.cli.main.main`) and ``python -m autoplan.cli``,
one module per subcommand (`plan_command`, `show_command`, `estimate_command`,
`run_command`, `profile_command`)."""
