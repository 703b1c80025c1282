"""``--config FILE``: command-line options from a YAML file, as ``vllm serve --config``.

The file's keys are long option names (``port: 8001``, ``max-model-len: 4096``; vLLM's
underscores are read as dashes), its values the options' values: ``true`` is the bare flag,
``false`` its ``--no-`` form where the option has one (else nothing), a list one value
after another (the flag before each for a repeatable option, ``--middleware``), a mapping
JSON. The options are put right after the subcommand and its positional model, so anything
the command line says wins over the file (vLLM's order: command line, file, defaults); a
positional model wins over the file's ``model:``, as in vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

FLAG = "--config"


def with_config_file(
    argv: list[str],
    is_flag: Callable[[str], bool],
    repeats: Callable[[str], bool] = lambda flag: False,
) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's options, placed right after
    the subcommand (and the positional model after it); unchanged without one.
    ``is_flag("--no-x")`` says whether a ``false`` value has a flag to become,
    ``repeats("--x")`` whether a list is given one ``--x VALUE`` per item. ``ValueError``
    for a second ``--config``, a missing path, a file that cannot be read or is not a YAML
    mapping."""
    given = [i for i, arg in enumerate(argv) if arg == FLAG or arg.startswith(FLAG + "=")]
    if not given:
        return argv
    if len(given) > 1:
        raise ValueError(f"{FLAG} given {len(given)} times; give one file")
    index = given[0]
    if argv[index] == FLAG:
        if index + 1 >= len(argv) or argv[index + 1].startswith("-"):
            raise ValueError(f"{FLAG} needs a YAML file")
        path, rest = argv[index + 1], argv[:index] + argv[index + 2:]
    else:
        path, rest = argv[index].split("=", 1)[1], argv[:index] + argv[index + 1:]
    config = _read_mapping(path)
    if not rest or rest[0].startswith("-"):
        return _options(config, is_flag, repeats) + rest
    # vLLM's order: the subcommand, its positional model (which wins over the file's
    # model:), the file's options, the rest of the command line.
    head = 2 if len(rest) > 1 and not rest[1].startswith("-") else 1
    if head == 2:
        config = {key: value for key, value in config.items() if _flag(key) != "--model"}
    return rest[:head] + _options(config, is_flag, repeats) + rest[head:]


def _read_mapping(path: str) -> dict[str, Any]:
    import yaml

    if Path(path).suffix not in (".yaml", ".yml"):
        raise ValueError(f"{FLAG} {path}: the file must be YAML (.yaml or .yml)")
    try:
        with open(path) as file:
            config = yaml.safe_load(file)
    except OSError as error:
        raise ValueError(f"{FLAG} {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{FLAG} {path}: not valid YAML: {_one_line(error)}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"{FLAG} {path}: must be a mapping of option names to values")
    return config


def _one_line(error: Exception) -> str:
    """A YAML error's problem and where it is, on one line (PyYAML's spans several)."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(error).split())


def _flag(key: Any) -> str:
    return "--" + str(key).lstrip("-").replace("_", "-")


def _options(
    config: dict[str, Any], is_flag: Callable[[str], bool], repeats: Callable[[str], bool]
) -> list[str]:
    out: list[str] = []
    for key, value in config.items():
        flag = _flag(key)
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif is_flag(no := "--no-" + flag[2:]):
                out.append(no)
        elif isinstance(value, list) and repeats(flag):
            for item in value:
                out += [flag, _text(item)]
        elif isinstance(value, list):
            if value:
                out += [flag, *(_text(item) for item in value)]
        elif value is not None:
            out += [flag, _text(value)]
    return out


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
