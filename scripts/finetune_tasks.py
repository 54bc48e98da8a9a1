"""Two classification tasks to fine-tune on, made from text on this machine (nothing to download):

- `pydoc`: a standard-library docstring (a public function's or class's, as written, without its
  name) labelled with the package it comes from: asyncio, email, logging or xml. The running
  Python's own library, so any machine has it; the demo pretrains on the same docstrings (the
  labels are what is new).
- `fortunes`: a fortune-cookie quotation labelled with its collection: computers, literature,
  politics or science (Debian's `fortunes` package, /usr/share/games/fortunes; skipped where it is
  not installed: `apt-get install fortunes`).
- `debian`: a Debian package's description (its synopsis and long description, from apt's
  package index and its Translation-en files: `apt-get update -o Acquire::Languages=en` fetches
  them where the image leaves them out) labelled with its section: games, graphics, net, science
  or sound; 600 of each, drawn with a fixed seed from the distinct descriptions (skipped without
  apt or its Translation-en files).

Each task is a shuffled 80/20 split into OUT/TASK/train.csv and validation.csv (`text,label`):

    python scripts/finetune_tasks.py runs/tasks
    pretrain finetune --config configs/finetune/classification.yaml finetune.init=runs/demo/run \\
        data.train=runs/tasks/pydoc/train.csv data.validation=runs/tasks/pydoc/validation.csv run.dir=runs/cls
"""

from __future__ import annotations

import argparse
import ast
import csv
import random
import shutil
import subprocess
import sysconfig
from pathlib import Path

PACKAGES = ("asyncio", "email", "logging", "xml")
FORTUNES = Path("/usr/share/games/fortunes")
COLLECTIONS = ("computers", "literature", "politics", "science")
SECTIONS = ("games", "graphics", "net", "science", "sound")
PER_SECTION = 600


def pydoc_examples() -> list[tuple[str, str]]:
    """(docstring, package) for every public function and class with a docstring of 40+ characters."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    examples = []
    for package in PACKAGES:
        for path in sorted((stdlib / package).rglob("*.py")):
            if {"test", "tests"} & set(path.parts):
                continue
            tree = ast.parse(path.read_bytes())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 40 and not node.name.startswith("_"):
                        examples.append((" ".join(doc.split()), package))
    return examples


def fortune_examples() -> list[tuple[str, str]]:
    """(quotation, collection) for every fortune of the four collections."""
    examples = []
    for name in COLLECTIONS:
        text = (FORTUNES / name).read_text(encoding="latin-1")
        examples += [(" ".join(f.split()), name) for f in text.split("\n%\n") if f.strip()]
    return examples


def package_fields(index: str):
    """Each record of a Debian package index (RFC 822 style) as a dict of its fields, a field's
    continuation lines joined to it."""
    for record in index.split("\n\n"):
        fields, key = {}, None
        for line in record.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line
            elif ":" in line:
                key, value = line.split(":", 1)
                fields[key] = value.strip()
        if fields:
            yield fields


def long_descriptions() -> dict[str, str]:
    """Description-md5 → the package's whole English description (its synopsis, then its long
    description, one line), from apt's Translation-en indexes."""
    targets = ["apt-get", "indextargets", "-o", "Acquire::Languages=en", "--format", "$(FILENAME)"]
    files = run([*targets, "Created-By: Translations"]).split()
    found = {}
    for path in files:
        for fields in package_fields(run(["/usr/lib/apt/apt-helper", "cat-file", path])):
            if "Description-md5" in fields and "Description-en" in fields:
                lines = [line.strip() for line in fields["Description-en"].splitlines()]
                found[fields["Description-md5"]] = " ".join(line for line in lines if line not in (".", ""))
    return found


def run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def debian_examples() -> list[tuple[str, str]]:
    """(description, section) for PER_SECTION distinct descriptions of each of SECTIONS."""
    descriptions = long_descriptions()
    if not descriptions:
        raise LookupError("no Translation-en index: run `apt-get update -o Acquire::Languages=en` first")
    found: dict[str, set[str]] = {section: set() for section in SECTIONS}
    for fields in package_fields(run(["apt-cache", "dumpavail"])):
        section = fields.get("Section", "").split("/")[-1]  # (contrib/games: games)
        text = descriptions.get(fields.get("Description-md5", ""))
        if section in found and text:
            found[section].add(text)
    rng, examples = random.Random(0), []
    for section in SECTIONS:
        texts = sorted(found[section])
        rng.shuffle(texts)
        examples += [(text, section) for text in texts[:PER_SECTION]]
    return examples


def write_split(examples: list[tuple[str, str]], out: Path) -> tuple[int, int]:
    examples = sorted(set(examples))  # (a docstring inherited word for word counts once)
    random.Random(0).shuffle(examples)
    held_out = len(examples) // 5
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("validation", examples[:held_out]), ("train", examples[held_out:])):
        with open(out / f"{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows(rows)
    return len(examples) - held_out, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory for OUT/pydoc, OUT/fortunes and OUT/debian")
    out = Path(parser.parse_args().out)
    tasks = {"pydoc": pydoc_examples}
    if (FORTUNES / COLLECTIONS[0]).is_file():
        tasks["fortunes"] = fortune_examples
    else:
        print(f"fortunes: skipped ({FORTUNES} has no collections: apt-get install fortunes)")
    if shutil.which("apt-cache"):
        tasks["debian"] = debian_examples
    else:
        print("debian: skipped (no apt-cache: not a Debian or Ubuntu machine)")
    for name, examples in tasks.items():
        try:
            found = examples()
        except LookupError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        train, validation = write_split(found, out / name)
        print(f"{name}: {train:,} training and {validation:,} validation examples in {out / name}")


if __name__ == "__main__":
    main()
