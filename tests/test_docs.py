"""The README and docs/*.md say what is true: every fenced ``python`` block runs,
every command they quote names a script that exists with flags its parser
accepts, and every relative link and #anchor resolves.

A block's fence info string says where it runs: ```` ```python ```` in this
process (a fresh namespace, the working directory a temporary one);
```` ```python cuda ```` the same under the ``cuda`` marker; ```` ```python torchrun ````
as a script on 2 gloo processes (torchrun); ```` ```python cuda torchrun ```` on one
process per GPU, up to 2, under the ``cuda`` marker. Any other word in the info
string is refused, so a block cannot opt out unseen.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import shardadam

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARKERS = {"cuda", "torchrun"}


@dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    language: str
    markers: frozenset[str]
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: pathlib.Path) -> list[Block]:
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        indent, info = len(opening.group(1)), opening.group(2).split()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: a code fence is never closed"
        code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
        language = info[0] if info else ""
        blocks.append(Block(path, i + 1, language, frozenset(info[1:]), code))
        i = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOCS for block in fenced_blocks(path)]
PYTHON_BLOCKS = [block for block in ALL_BLOCKS if block.language == "python"]
SHELL_BLOCKS = [block for block in ALL_BLOCKS if block.language in ("bash", "sh", "shell")]


def test_the_docs_hold_blocks_of_every_kind():
    """The extraction finds what the pages hold (a broken parser would pass every test below vacuously)."""
    kinds = {(b.path.name, tuple(sorted(b.markers))) for b in PYTHON_BLOCKS}
    assert ("README.md", ()) in kinds and ("README.md", ("torchrun",)) in kinds
    assert any(b.markers == {"cuda", "torchrun"} for b in PYTHON_BLOCKS)
    assert len(PYTHON_BLOCKS) >= 15 and SHELL_BLOCKS
    for block in ALL_BLOCKS:
        assert block.language in ("python", "bash", "text"), (
            f"{block.name}: fence language {block.language!r}: use python, bash or text")
        unknown = block.markers - RUN_MARKERS
        assert block.language == "python" or not block.markers, f"{block.name}: markers on a {block.language} block"
        assert not unknown, f"{block.name}: unknown markers {sorted(unknown)} (known: {sorted(RUN_MARKERS)})"


def _params(blocks):
    return [pytest.param(b, id=b.name, marks=[pytest.mark.cuda] if "cuda" in b.markers else []) for b in blocks]


@pytest.mark.parametrize("block", _params([b for b in PYTHON_BLOCKS if "torchrun" not in b.markers]))
def test_python_block_runs(block: Block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize("block", _params([b for b in PYTHON_BLOCKS if "torchrun" in b.markers]))
def test_python_block_runs_under_torchrun(block: Block, tmp_path):
    nproc = min(2, torch.cuda.device_count()) if "cuda" in block.markers else 2
    script = tmp_path / "block.py"
    # Once the block has run, each rank leaves without interpreter teardown,
    # where gloo's threads sometimes abort the process ("terminate called
    # without an active exception"; the spawned tests' _exit says the same):
    # a failure of torch's teardown, not of the block.
    script.write_text(block.code + "\nimport os as _os, sys as _sys\n_sys.stdout.flush()\n_sys.stderr.flush()\n"
                      "_os._exit(0)\n")
    package_dir = str(pathlib.Path(shardadam.__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [package_dir, os.environ.get("PYTHONPATH")])))
    # A bound on a hang, not a timing check: the blocks take seconds.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={nproc}", str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"{block.name} failed under torchrun:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"


# ------------------------------------------------------------------ commands

def _flags_of_python_script(path: pathlib.Path, seen: set | None = None) -> set[str]:
    """The --flags that `path`'s argparse parsers (and those of sibling modules it imports) accept."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    tree = ast.parse(path.read_text())
    flags = {"--help"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                sibling = path.parent / (name.split(".")[-1] + ".py")
                if sibling.exists():
                    flags |= _flags_of_python_script(sibling, seen)
    return flags


def _accepted_flags(script: pathlib.Path) -> set[str] | None:
    """Flags a script accepts; None when anything passes (pytest's arguments)."""
    if script.suffix == ".py":
        return _flags_of_python_script(script)
    text = script.read_text()
    forwarded = re.search(r'^(?!\s*#).*\s(\S+\.py)\b.*"\$@"', text, re.M)
    if forwarded:  # a shell script that hands its arguments to a Python script
        return _flags_of_python_script(ROOT / forwarded.group(1))
    if re.search(r'^(?!\s*#).*pytest.*"\$@"', text, re.M):
        return None
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)\)", text))  # `case` patterns: --dry-run)


def _check_command(words: list[str], where: str) -> str | None:
    """Checks one command (already split); returns what it ran, or None when it is no command of ours."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # environment assignments
        words = words[1:]
    if not words:
        return None
    program, args = words[0], words[1:]
    if program in ("python", "python3"):
        if args[:1] == ["-m"]:
            return None
        script_args = args
    elif program == "torchrun":
        script_args = [a for a in args if not a.startswith("--") and not re.fullmatch(r"\d+", a)]
        start = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
        script_args = args[start:] if start is not None else script_args
    elif program == "bash":
        script_args = args
    elif program == "pip":
        extras = [m for a in args for m in re.findall(r"^\.\[([\w,]+)\]$", a)]
        declared = set(re.findall(r"^(\w+) = \[", (ROOT / "pyproject.toml").read_text(), re.M))
        for extra in ",".join(extras).split(",") if extras else []:
            assert extra in declared, f"{where}: pip extra [{extra}] is not declared in pyproject.toml"
        return "pip"
    else:
        return None
    assert script_args, f"{where}: {program} with no script"
    script = ROOT / script_args[0]
    assert script.is_file(), f"{where}: {script_args[0]} does not exist"
    accepted = _accepted_flags(script)
    if accepted is not None:
        for arg in script_args[1:]:
            flag = arg.split("=")[0]
            if flag.startswith("--"):
                assert flag in accepted, f"{where}: {script_args[0]} accepts no {flag} (it accepts {sorted(accepted)})"
    return script_args[0]


def _shell_commands(code: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", code)
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _inline_commands(path: pathlib.Path) -> list[str]:
    """Commands quoted in running text: `python x.py --flag`, `torchrun ...`, `bash x.sh`."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    spans = re.findall(r"`([^`]+)`", text.replace("\n", " "))
    return [s for s in spans if re.match(r"^(\w+=\S+ )*(python3?|torchrun|bash|pip) \S", s)]


def _words(command: str) -> list[str]:
    # [--optional] and a|b|c alternatives are how the pages write usage: check each flag named.
    command = re.sub(r"\[(--[^\]]*)\]", r" \1 ", command)
    return [w.split("|")[0] for w in shlex.split(command) if w not in ("...",)]


@pytest.mark.parametrize("block", [pytest.param(b, id=b.name) for b in SHELL_BLOCKS])
def test_shell_block_commands_exist(block: Block):
    ran = [_check_command(_words(c), f"{block.name}: {c}") for c in _shell_commands(block.code)]
    assert any(ran), f"{block.name}: no command of this repository or pip found in {block.code!r}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_inline_commands_exist(path: pathlib.Path):
    for command in _inline_commands(path):
        _check_command(_words(command), f"{path.relative_to(ROOT)}: `{command}`")


def test_command_checks_catch_what_they_should():
    """The checker refuses a missing script, an unknown flag and an undeclared extra."""
    assert _check_command(_words("bash examples/run.sh --device cuda --bf16"), "ok") == "examples/run.sh"
    assert _check_command(_words("bash scripts/install.sh --dry-run"), "ok") == "scripts/install.sh"
    assert _check_command(_words("bash tests/run.sh -k adam --anything"), "ok") == "tests/run.sh"
    for bad in ("bash examples/missing.sh", "bash examples/run.sh --no-such-flag",
                "bash scripts/install.sh --force", "python benchmarks/bench_kernels.py --nope",
                "pip install .[nonexistent]"):
        with pytest.raises(AssertionError):
            _check_command(_words(bad), bad)


# --------------------------------------------------------------------- links

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    found, counts = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        n = counts.get(slug, 0)
        counts[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path: pathlib.Path):
    bad = []
    for target in links(path):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_anchor_rules_match_githubs():
    assert _slug("overlap_param_sync's first-use guard") == "overlap_param_syncs-first-use-guard"
    assert _slug("Kernels: `shardadam.kernels`") == "kernels-shardadamkernels"
    assert _slug("DistributedFusedAdam iteration on 2 x H200") == "distributedfusedadam-iteration-on-2-x-h200"
