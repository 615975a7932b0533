"""`llmaccel serve --config FILE`: flags kept in a YAML file, as `vllm serve --config` reads them.

A key is a flag's name without the dashes (`max-num-seqs` or `max_num_seqs`); its value is what the flag
would take (`true` for a switch, a list for a flag that repeats). The file's flags go before the command
line's, so a flag given on the command line wins. Every value goes through the parser's own checks
(types, choices), and a key the command does not have is a named error, not a silent no-op.
`llmaccel tune` writes these files.
"""

from __future__ import annotations

import argparse
import difflib
from pathlib import Path

import yaml


def read_config_file(path: Path) -> dict[str, object]:
    """The flags of a config file as {dest: value}; a named ValueError if it is not one."""
    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path}: not valid YAML ({exc})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    return {str(key).strip().lstrip("-").replace("-", "_"): value for key, value in values.items()}


def config_argv(parser: argparse.ArgumentParser, values: dict[str, object], source: str) -> list[str]:
    """The command-line words that set `values` on `parser` (a subcommand's parser)."""
    actions = {action.dest: action for action in parser._actions
               if action.option_strings and action.dest not in ("help", "config")}
    words: list[str] = []
    for dest, value in values.items():
        if dest not in actions:
            near = difflib.get_close_matches(dest, list(actions), n=1)
            hint = f" (did you mean {near[0].replace('_', '-')}?)" if near else ""
            raise ValueError(f"--config {source}: {dest.replace('_', '-')!r} is not a flag of {parser.prog}{hint}; "
                             f"`{parser.prog} --help` lists them")
        action = actions[dest]
        flag = max(action.option_strings, key=len)
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ValueError(f"--config {source}: {flag} is a switch; write true or false, not {value!r}")
            if value == isinstance(action, argparse._StoreTrueAction):
                words.append(flag)
            continue
        items = value if isinstance(value, list) else [value]
        if isinstance(value, list) and not isinstance(action, argparse._AppendAction) and action.nargs in (None, "?"):
            raise ValueError(f"--config {source}: {flag} takes one value, not a list")
        if isinstance(action, argparse._AppendAction):
            for item in items:
                words += [flag, _word(item)]
        elif value is not None:
            words += [flag, *(_word(item) for item in items)]
    return words


def _word(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value)
    return str(value)


def expand_config(argv: list[str], at: int, subparser: argparse.ArgumentParser) -> list[str]:
    """argv with each `--config FILE` after position `at` (the subcommand's first flag) replaced by the file's
    flags, which go before every command-line flag so that those win."""
    from_files: list[str] = []
    rest: list[str] = []
    words = iter(argv[at:])
    for word in words:
        if word == "--config" or word.startswith("--config="):
            path = word.split("=", 1)[1] if "=" in word else next(words, None)
            if not path:
                raise ValueError("--config needs a file name")
            from_files += config_argv(subparser, read_config_file(Path(path)), path)
        else:
            rest.append(word)
    return argv[:at] + from_files + rest


def write_config_file(path: Path, values: dict[str, object], comment: str = "") -> None:
    """A config file `--config` reads: `comment` lines first (as # comments), then the flags."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    body = yaml.safe_dump({key.replace("_", "-"): value for key, value in values.items()}, sort_keys=False,
                          allow_unicode=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines + [body]), encoding="utf-8")
