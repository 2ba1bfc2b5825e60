"""The docs as a guide: every sled-server and sled-edge option is in docs/configuration.md (sled-bench's are in its
own --help), and no user doc cites an issue number."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def options(parser, command=""):
    """(command, option, dest) for every option of a parser and its subcommands."""
    for action in parser._actions:
        if isinstance(getattr(action, "choices", None), dict):  # subcommands
            for name, sub in action.choices.items():
                yield from options(sub, f"{command} {name}".strip())
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                yield command, flag, action.dest


def test_every_command_line_option_is_in_the_configuration_guide():
    from edge_client.cli import build_parser as edge
    from verify_server.cli import build_parser as server

    guide = (ROOT / "docs" / "configuration.md").read_text()
    missing = []
    for tool, parser in (("sled-server", server()), ("sled-edge", edge())):
        for command, flag, dest in options(parser):
            plain = "--" + flag.removeprefix("--no-") if flag.startswith("--no-") else flag  # the off side of --X
            key = plain.removeprefix("--").replace("-", "_")
            if not (f"`{plain}" in guide or f"`{dest}`" in guide or f"`{key}`" in guide):
                missing.append(f"{tool} {command} {flag}".replace("  ", " "))
    assert not missing, f"options not in docs/configuration.md: {missing}"


def test_no_user_doc_cites_an_issue_number():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = re.findall(r"\bissues? #?\d+", path.read_text(), flags=re.IGNORECASE)
        assert not found, f"{path.name} cites {found}"
