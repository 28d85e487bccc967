"""The command line: Click commands, argument parsing, printing and exit codes. Sits on top of every other stage."""
