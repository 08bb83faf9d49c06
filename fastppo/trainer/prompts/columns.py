"""Columns mapped to the fields the trainer reads: the prompt column (``--prompt-field``) and the
others renamed by ``--field-map column=field``, each a keyword of every reward call.
"""

from ...errors import UsageError

# what reward calls pass besides the fields (``environments``: each row's, in a run with one)
REWARD_ARGUMENTS = ("prompts", "completions", "environments")


def parse_field_map(pairs: list) -> dict:
    """``{column: name}`` from ``["column=name", ...]``."""
    mapping = {}
    for pair in pairs or ():
        column, sep, name = pair.partition("=")
        if not sep or not column or not name.isidentifier():
            raise UsageError(f"--field-map entries are column=name, name a Python identifier, got {pair!r}")
        mapping[column] = name
    return mapping


def map_columns(rows: list, origins: list, prompt_field: str, field_map: dict, source: str) -> tuple:
    """``(prompts, fields)``: each row's prompt column and its other columns renamed by
    ``field_map``; a column named in either that no row of ``source`` has is an error listing
    the ones there."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for flag, name in [("--prompt-field", prompt_field)] + [("--field-map", c) for c in field_map]:
        if name not in columns:
            raise UsageError(
                f"{flag} {name}: {source} has no column {name!r} (its columns: {', '.join(map(str, columns))})"
            )
    for column in columns:
        name = field_map.get(column, column)
        if column != prompt_field and name in REWARD_ARGUMENTS:
            raise UsageError(
                f"{source}: column {column!r} would reach the reward functions as {name!r}, the name "
                f"of their own argument; rename it with --field-map {column}=another_name"
            )
    prompts, fields = [], []
    for row, origin in zip(rows, origins):
        if prompt_field not in row:
            raise UsageError(f"{origin}: the row has no {prompt_field!r} field")
        prompts.append(row[prompt_field])
        fields.append({field_map.get(k, k): v for k, v in row.items() if k != prompt_field})
    return prompts, fields
