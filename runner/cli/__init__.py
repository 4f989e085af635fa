"""The `runner` command line: parsers and rendering only. `main` parses, hands the work to
runner.api and the backends, and prints; each verb's module registers its own parser.
Imported by nothing below it."""
