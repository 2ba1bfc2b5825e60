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


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readmes_cpu_capacity_rows_are_the_capacity_sections_figures():
    readme = (ROOT / "README.md").read_text()
    capacity = section((ROOT / "docs" / "benchmarks.md").read_text(), "Capacity at a latency target")
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:6]] for line in readme.splitlines()
            if line.startswith("| 2-core CPU")}
    sled, base, ratio = rows["capacity at the target (1-32 devices tried)"]
    assert f"| sled | {sled.split()[0]} |" in capacity and f"| server-only | {base.split()[0]} |" in capacity
    assert f"serves {ratio} as many devices" in capacity
    counts = re.search(r"at ([\d, ]+) devices", next(k for k in rows if k.startswith("system tok/s"))).group(1)
    sled_rates, base_rates, ratios = rows[next(k for k in rows if k.startswith("system tok/s"))]
    for n, s, b, r in zip(counts.split(", "), sled_rates.split(", "), base_rates.split(", "), ratios.split(", ")):
        sled_row = re.search(rf"\| {n} \| sled \| ([\d.]+) \|.*\| {r} \|", capacity)
        base_row = re.search(rf"\| {n} \| server-only \| ([\d.]+) \|", capacity)
        assert sled_row and round(float(sled_row.group(1))) == int(s), (n, s, r)
        assert base_row and round(float(base_row.group(1))) == int(b), (n, b)
