"""The `cluster` commands: each parses its command line, builds its settings as values and
hands them to the library (`cluster.*`), the node (`node.*`) or the coordinator
(`coordinator.*`). Nothing below imports this package.

`cluster.cli.COMMAND_MODULES` imports one module of it, the command's, when the command runs;
each keeps its heavy imports (MLX, the tokenizer, the HTTP stack) inside the function that
needs them where another command of the module does without.
"""
