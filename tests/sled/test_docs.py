"""The docs as a guide: every sled-server and sled-edge option is in docs/configuration.md (sled-bench's are in its
own --help), every command they name exists, README's figures are their sections', and no issue number is cited."""

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


def test_readmes_gpu_rows_are_the_gpu_sections_figures():
    readme = (ROOT / "README.md").read_text()
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    system = section(benchmarks, "System benchmark on a GPU: SLED vs server-only vs device-only")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in readme.splitlines()
            if line.startswith("| H200") or line.startswith("| H100")]
    assert len(rows) == 3
    for server, figure, sled, base, ratio, drafts, heading in rows[:2]:
        size = re.search(r"random-weight (\d+B) Llama", server).group(1)
        assert heading == "System benchmark on a GPU" and figure == "system tok/s at 32 devices"
        sled_row = re.search(rf"\| {size} \| sled \| ([\d.]+) \|.*\| {re.escape(ratio)} \|", system)
        base_row = re.search(rf"\| {size} \| server-only \| ([\d.]+) \|", system)
        assert sled_row and f"{round(float(sled_row.group(1))):,}" == sled, (size, sled)
        assert base_row and f"{round(float(base_row.group(1))):,}" == base, (size, base)
        assert f"devices draft at {drafts}" in system.replace("\n", " ")
    step = section(benchmarks, "GPU step: per-segment attention against one padded call")
    server, figure, ratio, *_, heading = rows[2]
    assert heading == "GPU step" and "NVIDIA H100" in step and "1B Llama" in step
    assert re.search(rf"\| 1 \| 1 \| [\d.]+ \| [\d.]+ \| {re.escape(ratio)} \|", step), ratio


def test_readmes_modelled_rows_are_the_fleet_models_figures():
    readme = (ROOT / "README.md").read_text()
    fleet = section((ROOT / "docs" / "benchmarks.md").read_text(),
                    "Fleet model: capacity on GPUs, calibrated on this CPU")
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in readme.splitlines()
            if line.startswith("| modelled:")]
    assert len(rows) == 3
    for server, figure, sled, base, ratio, drafts, heading in rows:
        assert heading == "Fleet model" and figure == "capacity at the target, Jetson Orin Nano devices"
        name, ms = server.removeprefix("modelled: "), drafts.removesuffix(" ms/token")
        row = f"| {name} | Jetson Orin Nano ({ms}) | 50 ms | {sled.split()[0]} | {base.split()[0]} | {ratio} |"
        assert row in fleet, row


def named_commands(text: str) -> set[str]:
    """The commands a doc shows: code spans and the lines of code blocks that run sled-*, make, python -m or a file
    of the repository."""
    code = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    code += [line for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.DOTALL) for line in block.splitlines()]
    pattern = r"(sled-(?:bench|edge) [a-z-]+|make [a-z-]+|python -m [a-z_.]+|(?:scripts|tests|deploy)/[\w/.-]+)"
    return {m for piece in code for m in re.findall(pattern, piece)}


def test_every_command_the_docs_name_exists():
    import importlib.util

    from bench.cli import COMMANDS
    from edge_client.cli import build_parser as edge

    makefile = (ROOT / "Makefile").read_text()
    subcommands = next(a.choices for a in edge()._actions if isinstance(getattr(a, "choices", None), dict))
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= named_commands(path.read_text())
    missing = []
    for command in sorted(named):
        tool, _, what = command.partition(" ")
        exists = {"sled-bench": lambda: what in COMMANDS, "sled-edge": lambda: what in subcommands,
                  "make": lambda: re.search(rf"^{re.escape(what)}:", makefile, flags=re.MULTILINE),
                  "python": lambda: importlib.util.find_spec(what.removeprefix("-m "))}.get(
                      tool, lambda: (ROOT / command.rstrip(".")).exists())
        if not exists():
            missing.append(command)
    assert len(named) > 20 and not missing, f"commands the docs name that do not exist: {missing}"
