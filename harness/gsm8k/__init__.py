"""GSM8K through lm-eval: data source, task definitions, the lm-eval model, paired statistics, gates.

Only `tasks`, `lm` and `bench` import lm_eval (1-2 s); `data`, `records`, `stats`, `settings` and
`checks` are light and safe to import from the CLI.
"""
